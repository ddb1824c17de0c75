"""Which sandbox and port a request is for: the host name ``<port>-<sandbox>.<domain>``
(what the SDK's ``get_host(port)`` gives), or, on any host, the header pair
``E2b-Sandbox-Id`` and ``E2b-Sandbox-Port`` (E2B's header form, for clients without
wildcard DNS).  The headers win when both are there; half of the pair is an error, so
a client never reaches another target than the one it meant.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kibotos.core.errors import InvalidArgument, NotFound

_HOST = re.compile(r"([0-9]{1,5})-([0-9a-z]{26})\.([0-9a-z.-]+?)\.?(?::[0-9]{1,5})?")
_SANDBOX_ID = re.compile(r"[0-9a-z]{26}")
SANDBOX_ID_HEADER = b"e2b-sandbox-id"
SANDBOX_PORT_HEADER = b"e2b-sandbox-port"


@dataclass(frozen=True)
class Target:
    sandbox_id: str
    port: int

    @property
    def workspace_id(self) -> str:
        return f"ws-{self.sandbox_id}"


def _port(text: str, where: str) -> int:
    if not text.isascii() or not text.isdigit() or text.startswith("0") \
            or not 1 <= int(text) <= 65535:
        raise InvalidArgument(f"{where}: the port must be a number from 1 to 65535, "
                              f"not {text!r}")
    return int(text)


def target_of(headers: list[tuple[bytes, bytes]], domain: str | None) -> Target:
    """The target of a request with these (lowercased) headers; `NotFound` when it
    names none, `InvalidArgument` when it names one badly."""
    found: dict[bytes, str] = {}
    for name, value in headers:
        if name in (b"host", SANDBOX_ID_HEADER, SANDBOX_PORT_HEADER):
            found[name] = value.decode("ascii", "replace").strip().lower()
    sid, port = found.get(SANDBOX_ID_HEADER), found.get(SANDBOX_PORT_HEADER)
    if sid is not None or port is not None:
        if sid is None or port is None:
            raise InvalidArgument("send both E2b-Sandbox-Id and E2b-Sandbox-Port, or "
                                  "neither")
        if not _SANDBOX_ID.fullmatch(sid):
            raise NotFound(f"sandbox {sid!r} not found")
        return Target(sid, _port(port, "E2b-Sandbox-Port"))
    host = found.get(b"host", "")
    m = _HOST.fullmatch(host)
    if m is None or (domain is not None and m.group(3) != domain):
        shape = f"<port>-<sandbox>.{domain}" if domain else "<port>-<sandbox>.<domain>"
        raise NotFound(f"no sandbox named: use the host name {shape}, or send "
                       "E2b-Sandbox-Id and E2b-Sandbox-Port")
    return Target(m.group(2), _port(m.group(1), "the host name"))
