"""The parts of a gateway's TOML configuration every gateway has: ``listen``
addresses and the ``[ctrl]`` section (ctrl's URL, the gateway's own credential file and
the CA ctrl is verified against)::

    [ctrl]
    url = "https://ctrl.example:7400"
    credential_file = "/etc/kibotos/gateway-e2b.credential"  # <identity_id>:<secret>
    ca_file = "/etc/kibotos/ctrl-ca.crt"  # optional: ctrl's CA; default the system store
    dataplane_ca_file = "…/cluster-ca.crt"  # optional: the data planes' CA; default ca_file

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

from pydantic import BaseModel, ConfigDict, StrictStr, field_validator

from kibotos.core.errors import FailedPrecondition, InvalidArgument
from kibotos.tls.contexts import client_context_from_file, require_secure

if TYPE_CHECKING:
    import ssl


class Strict(BaseModel):
    """A configuration section: unknown keys refused, types checked, not coerced."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def check_listen(value: str) -> str:
    """``host:port``, port 0 allowed (the kernel picks one; the bound address is written
    to the state directory)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isascii() or not port.isdigit() \
            or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected host:port, got {value!r}")
    return value


def as_path(value: object) -> object:
    """A TOML string as a `Path` (strict mode would refuse the string)."""
    return Path(value) if isinstance(value, str) else value


class CtrlSection(Strict):
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

    _paths = field_validator("credential_file", "ca_file", "dataplane_ca_file",
                             mode="before")(as_path)

    def read_credential(self) -> str:
        """The gateway's bearer credential; a file others can read is refused."""
        path = self.credential_file
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
