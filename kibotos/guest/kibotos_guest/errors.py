"""Errors answered to the host, and the checks of request fields that produce them.

Every check names the request and the field, so a host bug reads as what it is
(``exec: field 'rows' must be in 1..65535``), never as a traceback in the guest.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    import pwd
    from typing import Any

#: The longest user name a request may carry (useradd's limit is 32).
MAX_USER_NAME = 32


class AgentError(Exception):
    """An error answered to the host as ``{code, message, details?}``; the codes are
    kibotos's (`kibotos/core/errors.py`), which the client turns back into its exceptions."""

    def __init__(self, code: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details or {}

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            body["details"] = self.details
        return body


def invalid(message: str) -> AgentError:
    return AgentError("invalid_argument", message)


def field(msg: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    """Read one field of a request, naming the request and field when it is wrong."""
    if key not in msg or msg[key] is None:
        if default is ...:
            raise invalid(f"{msg.get('type')}: field {key!r} is required")
        return default
    value = msg[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise invalid(f"{msg.get('type')}: field {key!r} has the wrong type")
    return value


def int_field(msg: dict[str, Any], key: str, lo: int, hi: int, default: Any = ...) -> Any:
    value = field(msg, key, int, default)
    if value is not None and value is not default and not lo <= value <= hi:
        raise invalid(f"{msg.get('type')}: field {key!r} must be in {lo}..{hi}")
    return value


def seconds_field(msg: dict[str, Any], key: str, default: Any = ...) -> float:
    value = float(field(msg, key, (int, float), default))
    if not 0 < value <= 86400:
        raise invalid(f"{msg.get('type')}: field {key!r} must be in (0, 86400] seconds")
    return value


def guest_path(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        raise invalid(f"{what} must be an absolute path, got {value!r}")
    if ".." in value.split("/"):
        raise invalid(f"{what} must not contain '..', got {value!r}")
    return os.path.normpath(value)


def user_field(msg: dict[str, Any]) -> pwd.struct_passwd | None:
    """The passwd entry of the request's ``user`` (a name), or None when it has none.

    A name, not a uid, because that is what E2B's SDK sends and what a person knows;
    the host checks the same rule (`kibotos/dataplane/clients/user_name.py`), this is
    the guest's own check, as every field is checked where it is used.  ``uid``/``gid``
    beside it would make two answers to one question, so they are refused."""
    name = field(msg, "user", str, None)
    if name is None:
        return None
    what = f"{msg.get('type')}: field 'user'"
    if not name or len(name) > MAX_USER_NAME:
        raise invalid(f"{what} must be 1 to {MAX_USER_NAME} characters, got {name!r}")
    if any(ord(c) < 0x20 or 0x7f <= ord(c) <= 0x9f or c in ":/\u2028\u2029" for c in name):
        raise invalid(f"{what} must not contain control characters, ':' or '/', got {name!r}")
    if msg.get("uid") is not None or msg.get("gid") is not None:
        raise invalid(f"{msg.get('type')}: give 'user' or 'uid'/'gid', not both")
    import pwd

    try:
        return pwd.getpwnam(name)
    except KeyError:
        raise invalid(f"{msg.get('type')}: no user named {name!r} in the guest") from None
