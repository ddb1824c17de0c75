"""The identity properties the ``direct`` supervisor applies, as systemd would: who the
unit runs as, which capabilities it may ever hold, and which network namespace it
joins.

Without systemd there is no manager to drop privileges for a unit, so the launcher
does it in the unit's process between fork and exec (`apply`, run as the ``Popen``
``preexec_fn``), in the order that keeps each step possible:

1. ``NetworkNamespacePath``: ``setns`` into the namespace (needs root, so first);
2. ``CapabilityBoundingSet``: every capability not listed leaves the bounding set
   (``[]`` or ``""``: all of them); afterwards no exec can grant one, not even a
   set-user-ID root binary;
3. ``NoNewPrivileges``: ``PR_SET_NO_NEW_PRIVS``, so set-user-ID bits and file
   capabilities are ignored by every later exec;
4. ``SupplementaryGroups``, ``Group``, ``User``: ``setgroups``, ``setresgid``,
   ``setresuid``.  A process that goes from root to another user loses its permitted,
   effective and ambient capabilities in that step (no ``SECBIT_KEEP_CAPS``).

``Group`` defaults to the user's primary group and the supplementary groups to none
(as systemd does).  ``AmbientCapabilities`` is accepted only empty: raising ambient
capabilities across a change of user is what this supervisor does not do.

`plan` reads the properties strictly and is called twice: by the supervisor before it
starts anything (a bad property is an error naming it, and nothing starts), and by the
launcher, which applies the result.  The launcher also checks the namespace before the
fork (`check_netns`): an error raised in `apply` reaches it only as Python's
"Exception occurred in preexec_fn", so a missing namespace would go unnamed.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import grp
import os
import pwd
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kibotos.sdk import procfs

#: Linux capability names in their numbering (linux/capability.h).
CAPABILITIES = procfs.CAPABILITIES
#: The properties this module applies (the others are recorded, see the supervisor).
APPLIED = frozenset({"NetworkNamespacePath", "CapabilityBoundingSet", "AmbientCapabilities",
                     "NoNewPrivileges", "User", "Group", "SupplementaryGroups"})
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
CLONE_NEWNET = 0x40000000
#: ioctl(2) on a namespace file: its type (a ``CLONE_NEW*`` value; linux/nsfs.h).
NS_GET_NSTYPE = 0xB703
_TRUE = frozenset({"yes", "true", "on", "1"})
_FALSE = frozenset({"no", "false", "off", "0"})


@dataclass(frozen=True)
class Confinement:
    """What `apply` does; None (or False) for a step the unit does not ask for."""

    netns: str | None = None
    #: Capability numbers to keep in the bounding set; None leaves it as it is.
    bounding: frozenset[int] | None = None
    no_new_privileges: bool = False
    uid: int | None = None
    gid: int | None = None
    groups: tuple[int, ...] | None = None


def _capabilities(name: str, value: Any) -> frozenset[int]:
    if isinstance(value, str):
        value = value.split()
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name} must be a list of capability names, got {value!r}")
    numbers = set()
    for cap in value:
        key = cap.upper() if cap.upper().startswith("CAP_") else f"CAP_{cap.upper()}"
        if key not in CAPABILITIES:
            raise ValueError(f"{name}: unknown capability {cap!r}")
        numbers.add(CAPABILITIES.index(key))
    return frozenset(numbers)


def _switch(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise ValueError(f"{name} must be a boolean (or yes/no), got {value!r}")


def _group_id(name: str, value: Any) -> int:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a group name, got {value!r}")
    try:
        return grp.getgrnam(value).gr_gid
    except KeyError:
        raise ValueError(f"{name}: no group {value!r} on this host") from None


def plan(properties: Mapping[str, Any]) -> Confinement:
    """The confinement `properties` ask for; ValueError naming the bad one."""
    netns = properties.get("NetworkNamespacePath")
    if netns is not None and (not isinstance(netns, str) or not netns.startswith("/")):
        raise ValueError(f"NetworkNamespacePath must be an absolute path, got {netns!r}")
    bounding = None
    if "CapabilityBoundingSet" in properties:
        bounding = _capabilities("CapabilityBoundingSet", properties["CapabilityBoundingSet"])
    if _capabilities("AmbientCapabilities", properties.get("AmbientCapabilities", [])):
        raise ValueError("AmbientCapabilities: the direct supervisor raises no ambient "
                         "capabilities (use the systemd supervisor)")
    no_new = _switch("NoNewPrivileges", properties.get("NoNewPrivileges", False))
    uid = gid = None
    groups: tuple[int, ...] | None = None
    user = properties.get("User")
    if user is not None:
        if not isinstance(user, str) or not user:
            raise ValueError(f"User must be a user name, got {user!r}")
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            raise ValueError(f"User: no user {user!r} on this host") from None
        uid, gid, groups = entry.pw_uid, entry.pw_gid, ()
    if properties.get("Group") is not None:
        gid = _group_id("Group", properties["Group"])
        groups = groups if groups is not None else ()
    extra = properties.get("SupplementaryGroups")
    if extra is not None:
        if not isinstance(extra, list | tuple):
            raise ValueError(f"SupplementaryGroups must be a list of group names, got "
                             f"{extra!r}")
        groups = tuple(_group_id("SupplementaryGroups", g) for g in extra)
    return Confinement(netns=netns, bounding=bounding, no_new_privileges=no_new, uid=uid,
                       gid=gid, groups=groups)


def check_netns(path: str) -> None:
    """That `path` is a network namespace this process can open (OSError naming what is
    wrong otherwise).  The launcher checks it before it forks the unit, so a namespace
    that is missing or of another kind fails the start with an error that says so."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            kind = fcntl.ioctl(fd, NS_GET_NSTYPE)
        except OSError:
            kind = None  # not a namespace file at all (ENOTTY)
        if kind != CLONE_NEWNET:
            raise OSError(errno.EINVAL, "not a network namespace")
    finally:
        os.close(fd)


def _last_capability() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except (OSError, ValueError):
        return len(CAPABILITIES) - 1


def apply(confinement: Confinement) -> None:
    """Apply `confinement` to this process (the unit, before its exec); an OSError ends
    the start, so a unit never runs with less confinement than it asked for."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"{what}: {os.strerror(code)}")

    if confinement.netns is not None:
        fd = os.open(confinement.netns, os.O_RDONLY | os.O_CLOEXEC)
        try:
            check(libc.setns(fd, CLONE_NEWNET), f"setns {confinement.netns}")
        finally:
            os.close(fd)
    if confinement.bounding is not None:
        for cap in range(_last_capability() + 1):
            if cap not in confinement.bounding:
                check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")
    if confinement.no_new_privileges:
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "set no_new_privs")
    if confinement.groups is not None:
        os.setgroups(list(confinement.groups))
    if confinement.gid is not None:
        os.setresgid(confinement.gid, confinement.gid, confinement.gid)
    if confinement.uid is not None:
        os.setresuid(confinement.uid, confinement.uid, confinement.uid)
