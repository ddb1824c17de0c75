"""The node's checks of its own process, before it takes the owner lock.

The spec ("The node service"): at startup the node first checks its own MainPID, its
cgroup, and whether leftover processes exist; then it takes the owner lock on the state
directory (`kibotos.node.host.layout.OwnerLock`).  The packaged unit (``KillMode=
control-group``, ``SendSIGKILL=yes``) makes systemd end every process of the old node
before a new one starts; these checks catch the setups where that guarantee does not
hold, before the node touches any state:

* the node is not the unit's main process (a wrapper script stays the parent: systemd
  then signals, tracks and notifies the wrong process);
* the node does not run in its unit's cgroup (moved out, or started some other way);
* processes other than the node itself are in the unit's cgroup: helpers (mkfs,
  guestfish, qemu-img …) of a previous node run that survived it.

They run only when systemd started the process (``INVOCATION_ID`` is set, as systemd
sets it for every service).  systemd is asked over D-Bus which unit has that invocation
(``GetUnitByInvocationID``; the answer is an alias path, so the unit is named by its
``Id`` property) and what its ``MainPID`` and ``ControlGroup`` are; the cgroup's
processes come from the cgroup file system.  A process started by hand (development,
tests, ``kibotos dev cluster``) has no unit to compare with and is not checked.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jeepney import DBusAddress, MessageType, new_method_call
from jeepney.io.blocking import open_dbus_connection
from jeepney.low_level import HeaderFields

from kibotos.core import procfs
from kibotos.core.errors import FailedPrecondition

DEFAULT_SYSTEM_BUS = "unix:path=/run/dbus/system_bus_socket"
_SYSTEMD = "org.freedesktop.systemd1"
_TIMEOUT = 10.0
_INVOCATION = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class NodeUnit:
    """The unit the node runs as, as systemd and the kernel agree it is."""

    unit: str
    invocation_id: str
    main_pid: int
    cgroup: str


def check_startup(*, environ: Mapping[str, str] | None = None,
                  proc_root: Path = Path("/proc"), pid: int | None = None) -> NodeUnit | None:
    """Run the checks; the node's unit when they pass, None when systemd did not start
    this process.  Raises `FailedPrecondition` naming what is wrong and what to do."""
    env = os.environ if environ is None else environ
    invocation = env.get("INVOCATION_ID", "").strip().lower()
    if not invocation:
        return None
    pid = os.getpid() if pid is None else pid
    if not _INVOCATION.fullmatch(invocation):
        raise FailedPrecondition(f"node startup check: INVOCATION_ID={invocation!r} is not "
                                 "a systemd invocation ID (32 hex digits)")
    bus = env.get("DBUS_SYSTEM_BUS_ADDRESS") or DEFAULT_SYSTEM_BUS
    unit, main_pid, cgroup = _ask_systemd(bus, invocation)
    if main_pid != pid:
        raise FailedPrecondition(
            f"node startup check: this process (PID {pid}) is not the main process of its "
            f"unit {unit} (MainPID {main_pid or 'none'}): run kibotos-node as the unit's "
            "ExecStart= itself, not through a wrapper that stays its parent (a node started "
            "by hand from inside another service inherits its INVOCATION_ID: unset it)")
    own = own_cgroup(proc_root, pid)
    if not cgroup or own != cgroup:
        raise FailedPrecondition(
            f"node startup check: this process runs in cgroup {own or '(unknown)'}, but its "
            f"unit {unit} has cgroup {cgroup or '(none)'}: the node must stay in its unit's "
            "cgroup, so that systemd ends its helpers with it")
    leftovers = sorted(p for p in cgroup_pids(cgroup, proc_root)
                       if p != pid and _alive(p, proc_root))
    if leftovers:
        described = ", ".join(f"{p} ({_cmdline(p, proc_root)})" for p in leftovers[:10])
        more = f" and {len(leftovers) - 10} more" if len(leftovers) > 10 else ""
        raise FailedPrecondition(
            f"node startup check: leftover processes of a previous node run in {unit}'s "
            f"cgroup {cgroup}: {described}{more}; stop the unit (systemctl stop {unit}) so "
            "that systemd ends them, then start it again")
    return NodeUnit(unit, invocation, main_pid, cgroup)


# ---------------------------------------------------------------------------- systemd


def _ask_systemd(bus: str, invocation: str) -> tuple[str, int, str]:
    """``(Id, MainPID, ControlGroup)`` of the unit with this invocation ID."""
    try:
        with open_dbus_connection(bus, auth_timeout=_TIMEOUT) as conn:
            (path,) = _call(conn, "/org/freedesktop/systemd1",
                            "org.freedesktop.systemd1.Manager", "GetUnitByInvocationID",
                            "ay", (bytes.fromhex(invocation),))
            unit = _get(conn, path, "org.freedesktop.systemd1.Unit", "Id")
            main_pid = _get(conn, path, "org.freedesktop.systemd1.Service", "MainPID")
            cgroup = _get(conn, path, "org.freedesktop.systemd1.Service", "ControlGroup")
    except _DBusError as exc:
        if exc.name in ("org.freedesktop.systemd1.NoUnitForInvocationID",
                        "org.freedesktop.systemd1.NoSuchUnit"):
            raise FailedPrecondition(
                f"node startup check: systemd knows no unit with INVOCATION_ID={invocation}"
                " (was this process started by this host's systemd?)") from None
        raise FailedPrecondition(f"node startup check: asking systemd on {bus} failed: "
                                 f"{exc}") from None
    except (OSError, ValueError, TimeoutError) as exc:
        raise FailedPrecondition(f"node startup check: cannot reach systemd on the D-Bus "
                                 f"bus {bus}: {exc}") from None
    return str(unit), int(main_pid), str(cgroup)


class _DBusError(Exception):
    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name


def _call(conn: Any, path: str, interface: str, method: str, signature: str,
          body: tuple[Any, ...]) -> tuple[Any, ...]:
    msg = new_method_call(DBusAddress(path, bus_name=_SYSTEMD, interface=interface),
                          method, signature, body)
    reply = conn.send_and_get_reply(msg, timeout=_TIMEOUT)
    if reply.header.message_type == MessageType.error:
        text = reply.body[0] if reply.body and isinstance(reply.body[0], str) else ""
        raise _DBusError(str(reply.header.fields.get(HeaderFields.error_name)), text)
    return tuple(reply.body)


def _get(conn: Any, path: str, interface: str, name: str) -> Any:
    (variant,) = _call(conn, path, "org.freedesktop.DBus.Properties", "Get", "ss",
                       (interface, name))
    return variant[1]


# ---------------------------------------------------------------------------- /proc


def own_cgroup(proc_root: Path, pid: int) -> str | None:
    """The cgroup systemd tracks `pid` in: the v2 (``0::``) path on a unified host, or on
    a hybrid one whose v2 path is not the root; else v1's ``name=systemd`` path."""
    try:
        text = (proc_root / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    unified = named = None
    for line in text.splitlines():
        _num, _, rest = line.partition(":")
        hierarchy, _, path = rest.partition(":")
        if line.startswith("0::"):
            unified = path
        elif "name=systemd" in hierarchy.split(","):
            named = path
    if unified not in (None, "/"):
        return unified
    return named or unified


def cgroup_pids(cgroup: str, proc_root: Path = Path("/proc")) -> set[int]:
    """Processes in `cgroup` and below it, in the hierarchies systemd tracks."""
    try:
        return procfs.cgroup_pids(cgroup, proc_root)
    except ValueError:
        raise FailedPrecondition("node startup check: the node's unit has the root "
                                 "cgroup") from None


def _alive(pid: int, proc_root: Path) -> bool:
    """Not gone and not a zombie (a zombie holds nothing but its PID)."""
    return procfs.start_time(pid, proc_root) is not None


def _cmdline(pid: int, proc_root: Path) -> str:
    try:
        raw = (proc_root / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    text = raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
    return text[:120] or "?"
