"""What a file operation says about a path (an *entry*) and how its failures read.

An entry carries what the E2B gateway's ``EntryInfo`` needs (name, type, path, size,
mode, permissions, owner, group, modified time, symlink target) and the numbers behind
them, so no caller has to stat again.  Entries describe the path itself (``lstat``): a
symlink is reported as a symlink, with its target, never followed.

OSError becomes an `AgentError` whose code the host maps to its exceptions: a missing
path is ``not_found``, EACCES/EPERM ``permission_denied``, a full disk (ENOSPC, EDQUOT)
``resource_exhausted`` with ``details.reason = "no_space"``; the message names the
operation and the guest path, never the ``--root`` it was resolved under.
"""

from __future__ import annotations

import errno
import os
import stat
import time

from ..errors import AgentError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

#: errno → (code, details.reason or None, wording when strerror is too terse)
_ERRNO: dict[int, tuple[str, str | None, str | None]] = {
    errno.ENOENT: ("not_found", None, "no such file or directory"),
    errno.EACCES: ("permission_denied", None, None),
    errno.EPERM: ("permission_denied", None, None),
    errno.ENOSPC: ("resource_exhausted", "no_space",
                   "no space left on the guest's file system (ENOSPC)"),
    errno.EDQUOT: ("resource_exhausted", "no_space", "disk quota exceeded (EDQUOT)"),
    errno.EEXIST: ("already_exists", None, None),
    errno.ENOTEMPTY: ("failed_precondition", "not_empty", "directory not empty"),
    errno.EISDIR: ("failed_precondition", "is_directory", None),
    errno.ENOTDIR: ("failed_precondition", "not_directory", None),
    errno.EROFS: ("failed_precondition", "read_only", "read-only file system"),
    errno.EXDEV: ("failed_precondition", "cross_device",
                  "source and destination are on different file systems"),
    errno.ELOOP: ("failed_precondition", "symlink_loop", None),
    errno.ENAMETOOLONG: ("invalid_argument", None, None),
    errno.EINVAL: ("invalid_argument", None, None),
}


def os_error(exc: OSError, what: str, path: str) -> AgentError:
    """`exc` from working on guest `path` as an answer for the host: ``what`` is the
    operation (``file_write``), `path` the guest path it was asked about."""
    code, reason, wording = _ERRNO.get(exc.errno or 0, ("internal", None, None))
    text = wording or (exc.strerror or str(exc)).lower()
    details: dict[str, Any] = {"path": path,
                               "errno": errno.errorcode.get(exc.errno or 0, str(exc.errno))}
    if reason:
        details["reason"] = reason
    return AgentError(code, f"{what} {path}: {text}", details)


def rfc3339(ns: int) -> str:
    """UTC, with the nanoseconds the file system keeps (trailing zeros dropped)."""
    seconds, fraction = divmod(ns, 1_000_000_000)
    text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    return text + (f".{fraction:09d}".rstrip("0") if fraction else "") + "Z"


def file_type(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


class Names:
    """uid → user name and gid → group name, looked up once per operation (a listing of
    thousands of files owned by one user reads /etc/passwd once)."""

    def __init__(self) -> None:
        self._users: dict[int, str] = {}
        self._groups: dict[int, str] = {}

    def user(self, uid: int) -> str:
        if uid not in self._users:
            import pwd

            self._users[uid] = _name_or_number(lambda: pwd.getpwuid(uid).pw_name, uid)
        return self._users[uid]

    def group(self, gid: int) -> str:
        if gid not in self._groups:
            import grp

            self._groups[gid] = _name_or_number(lambda: grp.getgrgid(gid).gr_name, gid)
        return self._groups[gid]


def _name_or_number(lookup: Callable[[], str], number: int) -> str:
    """The account's name, or its number when the guest has no such account."""
    try:
        return lookup()
    except KeyError:
        return str(number)


def entry(guest: str, real: str, st: os.stat_result, names: Names) -> dict[str, Any]:
    """The entry of guest path `guest` (found at `real`) from its ``lstat``."""
    mode = st.st_mode
    body: dict[str, Any] = {
        "name": os.path.basename(guest) or "/", "path": guest, "type": file_type(mode),
        "size": st.st_size, "mode": stat.S_IMODE(mode), "permissions": stat.filemode(mode),
        "owner": names.user(st.st_uid), "group": names.group(st.st_gid),
        "uid": st.st_uid, "gid": st.st_gid, "mtime_ns": st.st_mtime_ns,
        "modified_time": rfc3339(st.st_mtime_ns),
    }
    if stat.S_ISLNK(mode):
        try:
            body["symlink_target"] = os.readlink(real)
        except OSError:
            body["symlink_target"] = ""
    return body


def lstat_entry(guest: str, real: str, what: str, names: Names | None = None
                ) -> dict[str, Any]:
    try:
        st = os.lstat(real)
    except OSError as e:
        raise os_error(e, what, guest) from None
    return entry(guest, real, st, names or Names())
