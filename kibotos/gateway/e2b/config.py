"""The E2B gateway's configuration file (TOML), checked strictly before anything starts.

::

    listen = "127.0.0.1:3000"          # E2B's control API (E2B_API_URL)
    sandbox_listen = "127.0.0.1:3001"  # envd's API for every sandbox (E2B_SANDBOX_URL)
    state_dir = "/var/lib/kibotos/gateway-e2b"
    domain = "sandbox.example"         # optional: the sandboxes' `domain`

    [ctrl]
    url = "https://ctrl.example:7400"
    credential_file = "/etc/kibotos/gateway-e2b.credential"  # <identity_id>:<secret>
    ca_file = "/etc/kibotos/ctrl-ca.crt"  # optional: ctrl's CA; default the system store
    dataplane_ca_file = "…/cluster-ca.crt"  # optional: the data planes' CA; default ca_file

    [templates]                        # E2B template ID -> kibotos Template name
    base = "kibotos-base"

    [sandbox]
    default_timeout_s = 300            # E2B's default when a create names none
    max_timeout_s = 0                  # 0: no cap
    cpu_millis = 1000
    memory_bytes = 1073741824
    layer_size_bytes = 10737418240

The ``[ctrl]`` section and the credential file are every gateway's
(`kibotos.gateway.common.config`).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, StrictInt, StrictStr, field_validator

from kibotos.core import ids
from kibotos.core.errors import InvalidArgument
from kibotos.gateway.common.config import CtrlSection, Strict, as_path, check_listen


class SandboxSection(Strict):
    default_timeout_s: StrictInt = Field(default=300, ge=1)
    max_timeout_s: StrictInt = Field(default=0, ge=0)
    cpu_millis: StrictInt = Field(default=1000, ge=100)
    memory_bytes: StrictInt = Field(default=1 << 30, ge=64 << 20)
    layer_size_bytes: StrictInt = Field(default=10 << 30, ge=64 << 20)


class GatewayConfig(Strict):
    listen: StrictStr = "127.0.0.1:3000"
    sandbox_listen: StrictStr = "127.0.0.1:3001"
    state_dir: Path
    domain: StrictStr | None = None
    ctrl: CtrlSection
    templates: dict[StrictStr, StrictStr] = Field(default_factory=dict)
    sandbox: SandboxSection = SandboxSection()

    _check_listen = field_validator("listen", "sandbox_listen")(check_listen)
    _state_dir = field_validator("state_dir", mode="before")(as_path)

    @field_validator("templates")
    @classmethod
    def _names(cls, value: dict[str, str]) -> dict[str, str]:
        for alias, name in value.items():
            try:
                ids.check_template_name(name)
            except InvalidArgument as exc:
                raise ValueError(f"templates.{alias}: {exc.message}") from None
        return value

    def template_for(self, template_id: str) -> str:
        """The kibotos Template an E2B template ID names: an alias, else itself."""
        return self.templates.get(template_id, template_id)

    def read_credential(self) -> str:
        """The gateway's bearer credential (`CtrlSection.read_credential`)."""
        return self.ctrl.read_credential()
