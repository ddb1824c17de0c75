"""The one rule for a guest user name (``kibo workspace exec --user``, the data plane's
``user`` field, the E2B gateway's envd user), checked before anything is sent.

A name, not a uid: it is what E2B's SDK sends and what a person knows; the guest agent
looks it up in the guest's ``/etc/passwd`` (docs/guest-protocol.md, "The ``user``
field") and checks the same rule again.  Here, beside the client ends that every
caller already imports (and free of trio and pydantic, for the CLI's start-up time),
so the three cannot disagree on what a name may be.
"""

from __future__ import annotations

from typing import Any

from kibotos.core.control_chars import CONTROL_CHARACTERS
from kibotos.core.errors import InvalidArgument

#: The longest name (useradd's limit, and the guest agent's).
MAX_USER_NAME = 32


def check_user_name(value: Any, what: str = "user") -> str:
    """`value` if it is a user name, else `InvalidArgument` naming `what` and why: a
    string of 1 to 32 characters, no control characters, no ``:`` (passwd's separator,
    and Basic auth's) and no ``/``."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} must be a user name (a string), not "
                              f"{type(value).__name__}")
    if not value or len(value) > MAX_USER_NAME:
        raise InvalidArgument(f"{what} must be 1 to {MAX_USER_NAME} characters, got {value!r}")
    if CONTROL_CHARACTERS.search(value) or ":" in value or "/" in value:
        raise InvalidArgument(f"{what} must not contain control characters, ':' or '/', "
                              f"got {value!r}")
    return value


def optional_user_name(value: Any, what: str = "user") -> str | None:
    """None for an absent (None) name, else `check_user_name`."""
    return None if value is None else check_user_name(value, what)
