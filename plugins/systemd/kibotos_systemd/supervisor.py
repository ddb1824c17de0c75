"""The ``systemd`` supervisor: each unit is a transient service of the host's systemd.

`start` calls ``StartTransientUnit`` over D-Bus with the spec's properties
(`kibotos_systemd.properties`), waits for the start job to end (``JobRemoved``; with
``Type=exec`` that means the command was executed), then reads the unit back:
``InvocationID``, ``MainPID``, ``ExecMainStartTimestampMonotonic``, ``ControlGroup``,
``ActiveState``/``SubState``/``Result``, and from ``/proc/<MainPID>`` the start time,
executable file (path, dev:ino) and network namespace.  systemd is the main process's
parent, so unlike ``direct`` it knows how the unit ended (``Result``: ``success``,
``exit-code``, ``signal``, ``oom-kill`` …) and it owns the unit's cgroup, so `stop`
ends every process of the unit, including those that left its process group.

Units belong to systemd, not to the node: a new supervisor object (a restarted node)
finds them by name.  systemd forgets a unit that ended successfully (its garbage
collection; `describe` then returns None) and keeps a failed one, with its ``Result``,
until `stop` (``ResetFailedUnit``) or until its name is started again.

Options: ``bus`` (the D-Bus address; default ``DBUS_SYSTEM_BUS_ADDRESS`` or the system
bus), ``start_timeout`` (seconds for the start job; default 120).
"""

from __future__ import annotations

import builtins
import re
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import trio

from kibotos.sdk import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KibotosError,
    PermissionDenied,
    Supervisor,
    Unavailable,
    UnitInfo,
    UnitSpec,
    backend_options,
    check_unit_name,
    procfs,
)
from kibotos_systemd import processes
from kibotos_systemd.bus import (
    NO_SUCH_UNIT,
    SERVICE,
    UNIT,
    UNIT_EXISTS,
    UNKNOWN_OBJECT,
    DBusError,
    SystemdBus,
    system_bus_address,
    systemd_bus,
)
from kibotos_systemd.properties import unit_properties

_OPTIONS = frozenset({"bus", "start_timeout"})
_POLL = 0.05
#: After SIGKILL a process ends unless stuck in the kernel; give up (loudly) after this.
_KILL_GRACE = 60.0
#: Grace for processes a dead unit left behind, when its name is started again.
_LEFTOVER_TIMEOUT = 10.0
#: How long a stopped unit may take to be unloaded before `stop` stops waiting for it.
_UNLOAD_GRACE = 10.0
#: KillUnit's error for a unit without processes to signal.
NO_SUCH_PROCESS = "org.freedesktop.systemd1.NoSuchProcess"
#: ActiveStates in which a unit's main process may be running.
_LIVE_STATES = frozenset({"active", "activating", "deactivating", "reloading"})
#: systemd's exit statuses for a start that failed before or at exec (systemd.exec(5)).
_EXEC_STEPS = {200: "CHDIR", 201: "NICE", 202: "FDS", 203: "EXEC", 204: "MEMORY",
               205: "LIMITS", 206: "OOM_ADJUST", 207: "SIGNAL_MASK", 208: "STDIN",
               209: "STDOUT", 210: "CHROOT", 211: "IOPRIO", 212: "TIMERSLACK",
               213: "SECUREBITS", 214: "SETSCHEDULER", 215: "CPUAFFINITY", 216: "GROUP",
               217: "USER", 218: "CAPABILITIES", 219: "CGROUP", 220: "SETSID",
               222: "STDERR", 225: "NAMESPACE", 226: "NAMESPACE", 228: "SECCOMP"}


def systemd_unit(name: str) -> str:
    """The systemd unit of a supervisor name: itself if it ends in ``.service``, else
    ``<name>.service`` (both spellings name the same unit)."""
    return name if name.endswith(".service") else f"{name}.service"


def _map_error(exc: DBusError, what: str) -> KibotosError:
    if exc.name == "org.freedesktop.DBus.Error.InvalidArgs":
        return InvalidArgument(f"{what}: systemd refused: {exc.message}")
    if exc.name in ("org.freedesktop.DBus.Error.AccessDenied",
                    "org.freedesktop.DBus.Error.InteractiveAuthorizationRequired"):
        return PermissionDenied(f"{what}: {exc}")
    if exc.name in ("org.freedesktop.DBus.Error.ServiceUnknown",
                    "org.freedesktop.DBus.Error.NoReply",
                    "org.freedesktop.DBus.Error.NameHasNoOwner"):
        return Unavailable(f"{what}: systemd is not reachable on the bus: {exc}")
    return FailedPrecondition(f"{what}: {exc}")


class SystemdSupervisor(Supervisor):
    """`kibotos.sdk.Supervisor` on systemd's transient services; see the module
    docstring."""

    name: ClassVar[str] = "systemd"

    def __init__(self, options: Mapping[str, Any]) -> None:
        opts = backend_options("supervisor", self.name, options, _OPTIONS)
        bus = opts.text_or_none("bus")
        if bus is not None and not bus.startswith("unix:"):
            raise opts.invalid("bus", "is not a unix: D-Bus address (e.g. "
                                      "unix:path=/run/dbus/system_bus_socket)")
        self.bus_address = system_bus_address(bus)
        self.start_timeout = opts.seconds("start_timeout", 120.0)
        self._locks: dict[str, trio.Lock] = {}

    # ------------------------------------------------------------------ the protocol

    async def start(self, spec: UnitSpec) -> UnitInfo:
        name = check_unit_name(spec.name)
        unit = systemd_unit(name)
        argv = [str(a) for a in spec.argv]
        if not argv:
            raise InvalidArgument(f"unit {name}: argv is empty")
        log_path = Path(spec.log_path) if spec.log_path is not None else None
        props = unit_properties(spec, unit, argv, log_path)
        if log_path is not None:
            await trio.to_thread.run_sync(_make_log_dir, name, log_path)
        async with self._lock(unit), systemd_bus(self.bus_address) as bus:
            previous = await self._describe_on(bus, unit, name)
            if previous is not None:
                if previous.active:
                    raise AlreadyExists(
                        f"unit {name} is already running (PID {previous.main_pid}, "
                        f"invocation {previous.invocation_id})"
                    )
                # A dead unit (failed, or still unloading): what it left goes first.
                await self._stop_on(bus, unit, _LEFTOVER_TIMEOUT)
            jobs = await bus.subscribe_job_removed()
            try:
                (job,) = await bus.manager("StartTransientUnit", "ssa(sv)a(sa(sv))",
                                           (unit, "fail", props, []))
            except DBusError as exc:
                if exc.name == UNIT_EXISTS:
                    raise AlreadyExists(f"unit {name}: systemd already has a unit "
                                        f"{unit}: {exc.message}") from None
                raise _map_error(exc, f"start unit {name}") from None
            result = await self._wait_job(bus, jobs, str(job), unit, name)
            info = await self._describe_on(bus, unit, name)
            if result == "done" and info is not None:
                return info
            why = await self._failure(bus, unit, argv, result)
            if why is None and info is not None:
                return info
            await self._release(bus, unit)
            await self._stop_on(bus, unit, _LEFTOVER_TIMEOUT)
            raise FailedPrecondition(f"unit {name}: {why or f'start job {result}'}")

    async def describe(self, name: str) -> UnitInfo | None:
        check_unit_name(name)
        async with systemd_bus(self.bus_address) as bus:
            return await self._describe_on(bus, systemd_unit(name), name)

    async def list(self, prefix: str) -> builtins.list[UnitInfo]:
        """Transient services whose unit name starts with `prefix`, named by their full
        unit name (``<name>.service``)."""
        if prefix and not re.fullmatch(r"[A-Za-z0-9_.@:-]*", prefix):
            raise InvalidArgument(f"invalid unit name prefix {prefix!r}")
        async with systemd_bus(self.bus_address) as bus:
            try:
                (units,) = await bus.manager("ListUnitsByPatterns", "asas",
                                             ([], [f"{prefix}*"]))
            except DBusError as exc:
                raise _map_error(exc, f"list units {prefix}*") from None
            infos = []
            for unit in sorted({str(u[0]) for u in units if str(u[0]).endswith(".service")}):
                info = await self._describe_on(bus, unit, unit, transient_only=True)
                if info is not None:
                    infos.append(info)
            return infos

    async def stop(self, name: str, *, timeout: float) -> None:
        check_unit_name(name)
        unit = systemd_unit(name)
        async with self._lock(unit), systemd_bus(self.bus_address) as bus:
            await self._stop_on(bus, unit, timeout)

    # ------------------------------------------------------------------ reading

    def _lock(self, unit: str) -> trio.Lock:
        return self._locks.setdefault(unit, trio.Lock())

    async def _unit_path(self, bus: SystemdBus, unit: str) -> str | None:
        try:
            (path,) = await bus.manager("GetUnit", "s", (unit,))
        except DBusError as exc:
            if exc.name == NO_SUCH_UNIT:
                return None
            raise _map_error(exc, f"look up unit {unit}") from None
        return str(path)

    async def _properties(self, bus: SystemdBus, path: str, unit: str
                          ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The unit's Unit and Service properties; None once it was unloaded."""
        try:
            u = await bus.get_all(path, UNIT)
            s = await bus.get_all(path, SERVICE)
        except DBusError as exc:
            if exc.name in (NO_SUCH_UNIT, UNKNOWN_OBJECT):
                return None
            raise _map_error(exc, f"read unit {unit}") from None
        if u.get("Id") != unit:
            # GetUnit follows aliases: the name is an alias of another unit, which is
            # not a unit this supervisor started under that name.
            raise FailedPrecondition(f"unit {unit} is an alias of {u.get('Id')}, not a "
                                     "transient service of kibotos")
        return u, s

    async def _describe_on(self, bus: SystemdBus, unit: str, name: str, *,
                           transient_only: bool = False) -> UnitInfo | None:
        path = await self._unit_path(bus, unit)
        if path is None:
            return None
        props = await self._properties(bus, path, unit)
        if props is None:
            return None
        u, s = props
        if u.get("LoadState") in ("not-found", "bad-setting", "error", "masked") or \
                (transient_only and not u.get("Transient")):
            return None
        invocation = bytes(u.get("InvocationID") or b"").hex() or None
        exec_start = s.get("ExecStart") or []
        argv = tuple(str(a) for a in exec_start[0][1]) if exec_start else ()
        pid = int(s.get("MainPID") or 0)
        if pid > 0 and u.get("ActiveState") in _LIVE_STATES:
            facts = await trio.to_thread.run_sync(processes.facts, pid)
            # Read again: if the main process changed meanwhile, the facts belong to
            # nothing (or to a successor) and must not be shown as the unit's.
            again = await self._properties(bus, path, unit)
            if facts is not None and again is not None and \
                    int(again[1].get("MainPID") or 0) == pid and \
                    again[0].get("ActiveState") in _LIVE_STATES and \
                    processes.plausible_start(facts.start_time_ticks,
                                     int(s.get("ExecMainStartTimestampMonotonic") or 0)) and \
                    await trio.to_thread.run_sync(procfs.start_time, pid) == \
                    facts.start_time_ticks:
                return UnitInfo(
                    name=name, active=True, invocation_id=invocation, main_pid=pid,
                    start_time_ticks=facts.start_time_ticks, executable=facts.executable,
                    executable_dev_ino=facts.executable_dev_ino,
                    cgroup=str(s.get("ControlGroup") or "") or None,
                    netns_inode=facts.netns_inode, result=None, argv=argv,
                )
            s = again[1] if again is not None else s
        return UnitInfo(
            name=name, active=False, invocation_id=invocation, main_pid=None,
            start_time_ticks=None, executable=None, executable_dev_ino=None, cgroup=None,
            netns_inode=None, result=str(s.get("Result") or "gone"), argv=argv,
        )

    # ------------------------------------------------------------------ starting

    async def _wait_job(self, bus: SystemdBus, jobs: trio.MemoryReceiveChannel[Any],
                        job: str, unit: str, name: str) -> str:
        """The result of start job `job` (``done``, ``failed``, ``timeout`` …)."""
        with trio.move_on_after(self.start_timeout):
            async for msg in jobs:
                _id, path, _unit, result = msg.body
                if str(path) == job:
                    return str(result)
        await self._release(bus, unit)
        await self._stop_on(bus, unit, _LEFTOVER_TIMEOUT)
        raise DeadlineExceeded(f"unit {name}: the start job did not end within "
                               f"{self.start_timeout:g}s; the unit was stopped")

    async def _failure(self, bus: SystemdBus, unit: str, argv: builtins.list[str],
                       job_result: str) -> str | None:
        """Why a start failed, in words an operator can act on; None when it did not
        fail: the command was executed and ended before the start job did (a quick exit
        fails the job even with ``Type=exec``), which is a unit that ran and ended."""
        path = await self._unit_path(bus, unit)
        props = await self._properties(bus, path, unit) if path else None
        if props is None:
            return f"start job {job_result}; the unit is gone"
        _u, s = props
        result, status = str(s.get("Result") or ""), int(s.get("ExecMainStatus") or 0)
        code = int(s.get("ExecMainCode") or 0)  # CLD_EXITED 1, CLD_KILLED 2, CLD_DUMPED 3
        step = _EXEC_STEPS.get(status) if code == 1 else None
        if result != "timeout" and (code in (2, 3) or (code == 1 and step is None)):
            return None
        if step == "EXEC":
            return (f"cannot execute {argv[0]!r} (systemd exit status 203/EXEC: not found "
                    "or not executable)")
        if step is not None:
            return (f"start failed at step {step} (systemd exit status {status}; "
                    f"journalctl -u {unit} says why)")
        return f"start job {job_result} (Result={result}, exit status {status})"

    # ------------------------------------------------------------------ stopping

    async def _stop_on(self, bus: SystemdBus, unit: str, timeout: float) -> None:
        """StopUnit (SIGTERM to the whole cgroup with ``KillMode=control-group``); after
        `timeout` seconds SIGKILL to every process left; return once the unit is gone or
        inactive and its cgroup empty, with its failed state reset (so it is unloaded)."""
        path = await self._unit_path(bus, unit)
        if path is None:
            return
        props = await self._properties(bus, path, unit)
        if props is None:
            return
        cgroup = str(props[1].get("ControlGroup") or "")
        try:
            await bus.manager("StopUnit", "ss", (unit, "replace"))
        except DBusError as exc:
            if exc.name != NO_SUCH_UNIT:
                raise _map_error(exc, f"stop unit {unit}") from None
        with trio.move_on_after(max(timeout, 0.0)):
            while not await self._ended(bus, unit, cgroup):
                await trio.sleep(_POLL)
            await self._forget(bus, unit)
            return
        try:
            await bus.manager("KillUnit", "ssi", (unit, "all", int(signal.SIGKILL)))
        except DBusError as exc:
            # An inactive unit has no processes systemd would signal: `_ended` kills
            # what is left in its cgroup itself.
            if exc.name not in (NO_SUCH_UNIT, NO_SUCH_PROCESS):
                raise _map_error(exc, f"kill unit {unit}") from None
        with trio.move_on_after(_KILL_GRACE):
            while not await self._ended(bus, unit, cgroup, kill=True):
                await trio.sleep(_POLL)
            await self._forget(bus, unit)
            return
        left = await trio.to_thread.run_sync(processes.live_cgroup_pids, cgroup)
        raise DeadlineExceeded(
            f"unit {unit}: processes {', '.join(map(str, sorted(left))) or '(none)'} of "
            f"cgroup {cgroup} survived SIGKILL for {_KILL_GRACE:.0f}s (stuck in the kernel?)"
        )

    async def _ended(self, bus: SystemdBus, unit: str, cgroup: str, *,
                     kill: bool = False) -> bool:
        path = await self._unit_path(bus, unit)
        props = await self._properties(bus, path, unit) if path else None
        if props is not None and props[0].get("ActiveState") not in ("inactive", "failed"):
            return False
        left = await trio.to_thread.run_sync(processes.live_cgroup_pids, cgroup)
        if left and kill:
            # The unit ended but processes remain in its cgroup (systemd gave up on
            # them, or they arrived late): kill them ourselves.
            for pid in left:
                processes.kill(pid)
        return not left

    async def _release(self, bus: SystemdBus, unit: str) -> None:
        """Drop the reference `start` took with ``AddRef`` (else the unit could not be
        unloaded while this connection lives)."""
        path = await self._unit_path(bus, unit)
        if path is None:
            return
        try:
            await bus.call(path, UNIT, "Unref")
        except DBusError as exc:
            if exc.name not in (NO_SUCH_UNIT, UNKNOWN_OBJECT):
                raise _map_error(exc, f"release unit {unit}") from None

    async def _forget(self, bus: SystemdBus, unit: str) -> None:
        """Reset a failed state so systemd unloads the unit, and wait until it did."""
        try:
            await bus.manager("ResetFailedUnit", "s", (unit,))
        except DBusError as exc:
            if exc.name != NO_SUCH_UNIT:
                raise _map_error(exc, f"reset unit {unit}") from None
        with trio.move_on_after(_UNLOAD_GRACE):
            while await self._unit_path(bus, unit) is not None:
                await trio.sleep(_POLL)


def _make_log_dir(name: str, log_path: Path) -> None:
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FailedPrecondition(f"unit {name}: cannot create the log directory "
                                 f"{log_path.parent}: {exc.strerror}") from None
