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

    [tls]                              # optional on loopback, required elsewhere
    cert_file = "/etc/kibotos/gateway-exposure.crt"  # e.g. *.sandbox.example, PEM chain
    key_file = "/etc/kibotos/gateway-exposure.key"

    [limits]
    max_connections = 1024             # client connections served at once
    idle_timeout_s = 120               # a kept-alive connection with no request is closed
    header_timeout_s = 30              # the time a client has to send a request's head

Plain HTTP is served on a loopback ``listen`` only (a TLS terminator on the same host
in front): traffic access tokens cross this listener, and a secret never crosses a
network in the clear.  Elsewhere ``[tls]`` is required.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from pydantic import Field, StrictInt, StrictStr, field_validator, model_validator

from kibotos.core.errors import InvalidArgument
from kibotos.gateway.common.config import CtrlSection, Strict, as_path, check_listen
from kibotos.tls.contexts import is_loopback
from kibotos.tls.server import server_context


class TlsSection(Strict):
    cert_file: Path
    key_file: Path

    _paths = field_validator("cert_file", "key_file", mode="before")(as_path)

    def context(self) -> ssl.SSLContext:
        """The listener's context (TLS 1.2 at least, HTTP/1.1 by ALPN); a file that
        cannot be read or a key that does not match is an `InvalidArgument` naming
        the files."""
        context = server_context()
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise InvalidArgument(f"tls.cert_file {self.cert_file} / tls.key_file "
                                  f"{self.key_file}: {exc}") from None
        return context


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
    tls: TlsSection | None = None
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

    @model_validator(mode="after")
    def _secure(self) -> ExposureConfig:
        host = self.listen.rpartition(":")[0]
        if self.tls is None and not is_loopback(host):
            raise ValueError(f"listen {self.listen} is not a loopback address: give [tls] "
                             "cert_file and key_file (traffic tokens cross this listener)")
        return self

    def read_credential(self) -> str:
        """The gateway's bearer credential (`CtrlSection.read_credential`)."""
        return self.ctrl.read_credential()
