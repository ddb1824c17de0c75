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

ctrl is verified against ``ca_file`` (ctrl's ``<state_dir>/cluster-ca.crt``, or the CA
of the operator's certificate), as a node verifies it against ``[node] ctrl_ca_file``;
plain ``http://`` is refused unless ctrl is on loopback (the credential is a secret).
The credential file holds the gateway's own operator identity (docs/gateways.md); it
must be readable by its owner only, since it lets its holder act as an operator.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from kibotos import ids
from kibotos.errors import FailedPrecondition, InvalidArgument
from kibotos.tls.contexts import client_context_from_file, require_secure

if TYPE_CHECKING:
    import ssl


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _listen(value: str) -> str:
    """``host:port``, port 0 allowed (the kernel picks one; the bound address is written
    to the state directory)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isascii() or not port.isdigit() \
            or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected host:port, got {value!r}")
    return value


class CtrlSection(_Strict):
    url: StrictStr
    credential_file: Path
    #: The CA ctrl's certificate is verified against; None: the system trust store.
    ca_file: Path | None = None
    #: The CA nodes' data-plane certificates are verified against: the cluster CA
    #: (ctrl's ``<state_dir>/cluster-ca.crt``).  None: `ca_file`, which is that file
    #: when ctrl serves a certificate of its own cluster CA.
    dataplane_ca_file: Path | None = None

    @field_validator("url")
    @classmethod
    def _http(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"expected an http(s):// URL, got {value!r}")
        try:
            require_secure(value, "the URL")
        except InvalidArgument as exc:
            raise ValueError(exc.message) from None
        return value.rstrip("/")

    def tls(self) -> ssl.SSLContext:
        """The context ctrl is verified with (an unreadable CA file is an
        `InvalidArgument` naming ctrl.ca_file)."""
        return client_context_from_file(self.ca_file, "ctrl.ca_file")

    def dataplane_tls(self) -> ssl.SSLContext:
        """The context data planes are verified with (`dataplane_ca_file`)."""
        if self.dataplane_ca_file is not None:
            return client_context_from_file(self.dataplane_ca_file, "ctrl.dataplane_ca_file")
        return self.tls()

    @field_validator("credential_file", "ca_file", "dataplane_ca_file", mode="before")
    @classmethod
    def _path(cls, value: object) -> object:
        return Path(value) if isinstance(value, str) else value


class SandboxSection(_Strict):
    default_timeout_s: StrictInt = Field(default=300, ge=1)
    max_timeout_s: StrictInt = Field(default=0, ge=0)
    cpu_millis: StrictInt = Field(default=1000, ge=100)
    memory_bytes: StrictInt = Field(default=1 << 30, ge=64 << 20)
    layer_size_bytes: StrictInt = Field(default=10 << 30, ge=64 << 20)


class GatewayConfig(_Strict):
    listen: StrictStr = "127.0.0.1:3000"
    sandbox_listen: StrictStr = "127.0.0.1:3001"
    state_dir: Path
    domain: StrictStr | None = None
    ctrl: CtrlSection
    templates: dict[StrictStr, StrictStr] = Field(default_factory=dict)
    sandbox: SandboxSection = SandboxSection()

    _check_listen = field_validator("listen", "sandbox_listen")(_listen)

    @field_validator("state_dir", mode="before")
    @classmethod
    def _path(cls, value: object) -> object:
        return Path(value) if isinstance(value, str) else value

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
        """The gateway's bearer credential; a file others can read is refused."""
        path = self.ctrl.credential_file
        try:
            mode = os.stat(path).st_mode & 0o777
            text = path.read_text().strip()
        except OSError as exc:
            raise FailedPrecondition(f"cannot read the gateway's credential file {path}: "
                                     f"{exc.strerror}") from None
        if mode & 0o077:
            raise FailedPrecondition(f"credential file {path} has mode {mode:04o}: it must "
                                     "be readable by its owner only (chmod 600)")
        if ":" not in text:
            raise FailedPrecondition(f"credential file {path} does not hold "
                                     "<identity_id>:<secret>")
        return text
