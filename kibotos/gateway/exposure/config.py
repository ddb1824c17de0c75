"""The Exposure gateway's configuration file (TOML), checked strictly before anything
starts.

::

    listen = "127.0.0.1:3002"          # the proxy (plain HTTP; TLS in front: docs/gateways.md)
    metrics_listen = "127.0.0.1:9464"  # GET /metrics, kept off the public listener
    state_dir = "/var/lib/kibotos/gateway-exposure"
    domain = "sandbox.example"         # optional: only <port>-<id>.<domain> is served

    [ctrl]                             # as every gateway's (kibotos.gateway.common.config)
    url = "https://ctrl.example:7400"
    credential_file = "/etc/kibotos/gateway-exposure.credential"
    ca_file = "/etc/kibotos/ctrl-ca.crt"

    [limits]
    max_connections = 1024             # client connections served at once
    idle_timeout_s = 120               # a kept-alive connection with no request is closed
    header_timeout_s = 30              # the time a client has to send a request's head
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, StrictInt, StrictStr, field_validator

from kibotos.gateway.common.config import CtrlSection, Strict, as_path, check_listen


class Limits(Strict):
    max_connections: StrictInt = Field(default=1024, ge=1, le=1 << 20)
    idle_timeout_s: StrictInt = Field(default=120, ge=1)
    header_timeout_s: StrictInt = Field(default=30, ge=1)


class ExposureConfig(Strict):
    listen: StrictStr = "127.0.0.1:3002"
    metrics_listen: StrictStr = "127.0.0.1:9464"
    state_dir: Path
    domain: StrictStr | None = Field(default=None, min_length=1, max_length=253)
    ctrl: CtrlSection
    limits: Limits = Limits()

    _check_listen = field_validator("listen", "metrics_listen")(check_listen)
    _state_dir = field_validator("state_dir", mode="before")(as_path)

    @field_validator("domain")
    @classmethod
    def _domain(cls, value: str | None) -> str | None:
        if value is not None and (value != value.lower().strip(".") or " " in value):
            raise ValueError(f"expected a lowercase domain name without a leading or "
                             f"trailing dot, got {value!r}")
        return value

    def read_credential(self) -> str:
        """The gateway's bearer credential (`CtrlSection.read_credential`)."""
        return self.ctrl.read_credential()
