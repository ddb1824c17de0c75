"""The ``direct`` supervisor: units as detached process groups, tracked in a state dir.

For hosts without systemd, for development and for tests.  Each unit is started by the
launcher (`kibotos_direct.launch`) in its own session, so it survives the node and is
not its child; what identifies it is recorded in ``<state_dir>/<name>.json``: unit name,
argv, invocation ID, MainPID (also the process group), boot ID, start time (field 22 of
``/proc/<pid>/stat``), executable path and dev:ino, cgroup, network namespace inode.

A unit is active only while its recorded PID is alive with the recorded start time in
the recorded boot: a PID the kernel handed to another process is never mistaken for the
unit, and `stop` never signals a process group that is not the unit's.  Everything
lives in the state directory, so a new supervisor object (a restarted node) sees the
same units.  Blocking work (/proc scans, the launcher, file writes) runs in a worker
thread (`trio.to_thread.run_sync`) so the node's event loop never stalls.

Identity properties are applied as systemd applies them (`kibotos_direct.confine`:
``User``, ``Group``, ``SupplementaryGroups``, ``NoNewPrivileges``,
``CapabilityBoundingSet``, ``NetworkNamespacePath``), so a unit meant to run without
privileges runs without them here too.  What it cannot do, unlike systemd: resource
and sandbox properties (no cgroups or mount namespaces of its own: ``MemoryMax``,
``ProtectSystem``, ``ReadWritePaths`` … are recorded, not applied), the exit status
of a unit (it is not the parent; ``result`` is ``gone``), and processes of the unit
that leave its process group escape `stop`.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import trio

from kibotos.sdk import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    Supervisor,
    UnitInfo,
    UnitSpec,
    atomicfile,
    backend_options,
    check_unit_name,
    procfs,
)
from kibotos_direct import confine

#: systemd's default PATH for services; the node's own environment is not inherited.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_OPTIONS = frozenset({"state_dir", "log_dir", "python", "kill_grace"})
#: How often `stop` looks whether the group is gone.
_POLL = 0.05
#: After SIGKILL a process ends unless stuck in the kernel; give up (loudly) after this.
_KILL_GRACE = 60.0
_LAUNCH_TIMEOUT = 120.0
#: Grace for processes a dead unit left behind, when its name is started again.
_LEFTOVER_TIMEOUT = 10.0


def _json_safe(value: Mapping[str, Any]) -> Any:
    return json.loads(json.dumps(dict(value), default=str))


class DirectSupervisor(Supervisor):
    """`kibotos.sdk.Supervisor` without systemd.

    Options: ``state_dir`` (required; one JSON record per unit), ``log_dir`` (default
    ``<state_dir>/logs``, for units whose spec names no ``log_path``), ``python`` (the
    interpreter that runs the launcher; default: this one), ``kill_grace`` (seconds
    `stop` waits after SIGKILL before it gives up on processes stuck in the kernel and
    raises DeadlineExceeded naming them; default 60).
    """

    name: ClassVar[str] = "direct"

    def __init__(self, options: Mapping[str, Any]) -> None:
        opts = backend_options("supervisor", self.name, options, _OPTIONS)
        self.state_dir = opts.required_path("state_dir")
        self.log_dir = opts.path("log_dir", self.state_dir / "logs")
        self.python = opts.text("python", sys.executable)
        self.kill_grace = opts.seconds("kill_grace", _KILL_GRACE, most=3600)
        self._locks: dict[str, trio.Lock] = {}

    # ------------------------------------------------------------------ the protocol

    async def start(self, spec: UnitSpec) -> UnitInfo:
        name = check_unit_name(spec.name)
        argv = [str(a) for a in spec.argv]
        if not argv:
            raise InvalidArgument(f"unit {name}: argv is empty")
        try:
            confine.plan(spec.properties)
        except ValueError as exc:
            raise InvalidArgument(f"unit {name}: {exc}") from None
        async with self._lock(name):
            previous = await trio.to_thread.run_sync(self._read_record, name)
            if previous is not None:
                current = await trio.to_thread.run_sync(self._info, name, previous)
                if current.active:
                    raise AlreadyExists(
                        f"unit {name} is already running (PID {current.main_pid}, "
                        f"invocation {current.invocation_id})"
                    )
                # The main process ended; what it left in its group goes with it, as
                # systemd's control-group kill mode does, before the name is reused.
                await self._end_group(name, previous, _LEFTOVER_TIMEOUT)
            invocation_id = secrets.token_hex(16)
            env = {"PATH": DEFAULT_PATH, **spec.environment, "INVOCATION_ID": invocation_id}
            request = {
                "name": name,
                "argv": argv,
                "env": env,
                "cwd": str(spec.working_directory or "/"),
                "log_path": str(spec.log_path or self.log_dir / f"{name}.log"),
                "invocation_id": invocation_id,
                "properties": _json_safe(spec.properties),
                "record_path": str(self._record_path(name)),
            }
            await trio.to_thread.run_sync(self._launch, request)
            info = await self.describe(name)
            assert info is not None  # the launcher wrote the record
            return info

    async def describe(self, name: str) -> UnitInfo | None:
        check_unit_name(name)
        return await trio.to_thread.run_sync(self._describe_sync, name)

    async def list(self, prefix: str) -> list[UnitInfo]:
        return await trio.to_thread.run_sync(self._list_sync, prefix)

    async def stop(self, name: str, *, timeout: float) -> None:
        check_unit_name(name)
        async with self._lock(name):
            record = await trio.to_thread.run_sync(self._read_record, name)
            if record is None:
                return
            await self._end_group(name, record, timeout)
            await trio.to_thread.run_sync(self._forget, name)

    # ------------------------------------------------------------------ helpers

    def _lock(self, name: str) -> trio.Lock:
        return self._locks.setdefault(name, trio.Lock())

    def _record_path(self, name: str) -> Path:
        return self.state_dir / f"{name}.json"

    def _launch(self, request: dict[str, Any]) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k != "KIBOTOS_FAILPOINTS"}
        try:
            done = subprocess.run(
                [self.python, "-m", "kibotos_direct.launch"],
                input=json.dumps(request),
                capture_output=True,
                text=True,
                env=env,
                timeout=_LAUNCH_TIMEOUT,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FailedPrecondition(f"unit {request['name']}: launcher failed: {exc}") from exc
        lines = done.stdout.strip().splitlines()
        try:
            answer = json.loads(lines[-1]) if lines else None
        except ValueError:
            answer = None
        if done.returncode != 0 or not isinstance(answer, dict):
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise FailedPrecondition(
                f"unit {request['name']}: launcher exited with status {done.returncode}: {tail}"
            )
        if "error" in answer:
            raise FailedPrecondition(
                f"unit {request['name']}: cannot execute {request['argv'][0]!r}: "
                f"{answer['error']}"
            )

    def _read_record(self, name: str) -> dict[str, Any] | None:
        try:
            record = atomicfile.read_json(self._record_path(name))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise FailedPrecondition(
                f"unit {name}: unreadable record {self._record_path(name)}: {exc}"
            ) from exc
        if not isinstance(record, dict):
            raise FailedPrecondition(f"unit {name}: record {self._record_path(name)} is "
                                     "not a JSON object")
        return record

    @staticmethod
    def _is_same_process(record: Mapping[str, Any]) -> bool:
        """Whether the recorded main PID is still the process that was started."""
        pid = record.get("main_pid")
        if not isinstance(pid, int) or record.get("start_time_ticks") is None:
            return False
        if record.get("boot_id") != procfs.boot_id():
            return False
        stat = procfs.read_stat(pid)
        return (
            stat is not None
            and not stat.dead
            and stat.start_time_ticks == record["start_time_ticks"]
        )

    def _describe_sync(self, name: str) -> UnitInfo | None:
        record = self._read_record(name)
        if record is None:
            return None
        return self._info(name, record)

    def _info(self, name: str, record: Mapping[str, Any]) -> UnitInfo:
        argv = tuple(str(a) for a in record.get("argv") or ())
        if self._is_same_process(record):
            pid: int = record["main_pid"]
            exe = procfs.executable(pid)
            cgroup = procfs.cgroup(pid)
            netns = procfs.netns_inode(pid)
            # Read the facts first, then check again: if the process ended meanwhile,
            # the facts may belong to nothing (or to a successor) and must not be shown.
            if self._is_same_process(record):
                return UnitInfo(
                    name=name,
                    active=True,
                    invocation_id=record.get("invocation_id"),
                    main_pid=pid,
                    start_time_ticks=record["start_time_ticks"],
                    executable=exe[0] if exe else None,
                    executable_dev_ino=exe[1] if exe else None,
                    cgroup=cgroup,
                    netns_inode=netns,
                    argv=argv,
                )
        return UnitInfo(
            name=name,
            active=False,
            invocation_id=record.get("invocation_id"),
            main_pid=None,
            start_time_ticks=None,
            executable=None,
            executable_dev_ino=None,
            cgroup=None,
            netns_inode=None,
            result="gone",
            argv=argv,
        )

    def _list_sync(self, prefix: str) -> builtins.list[UnitInfo]:
        try:
            paths = sorted(self.state_dir.glob("*.json"))
        except OSError:
            return []
        infos = []
        for path in paths:
            name = path.name[: -len(".json")]
            if name.startswith(".") or not name.startswith(prefix):
                continue
            record = self._read_record(name)
            if record is not None:
                infos.append(self._info(name, record))
        return infos

    def _group_members(self, record: Mapping[str, Any]) -> builtins.list[int]:
        """Live processes of the unit's process group, or [] when the group ID no longer
        belongs to the unit.

        The kernel does not hand out a PID that is still some group's ID, so while any
        process of the unit's group lives, the group ID is the unit's.  It is someone
        else's only if the group's leader PID now runs a process with another start time
        (the unit's group died out and the number was reused), or the host rebooted.
        """
        pgrp = record.get("process_group", record.get("main_pid"))
        if not isinstance(pgrp, int) or pgrp <= 1:
            return []
        if record.get("boot_id") != procfs.boot_id():
            return []
        leader = procfs.read_stat(pgrp)
        if leader is not None and leader.start_time_ticks != record.get("start_time_ticks"):
            return []
        return procfs.live_group_members(pgrp)

    async def _end_group(self, name: str, record: Mapping[str, Any], timeout: float) -> None:
        """SIGTERM (and SIGCONT, so a stopped process can act on it) to the group; after
        `timeout` seconds SIGKILL; return once no process of the group is left."""
        pgrp = int(record.get("process_group", record.get("main_pid")) or 0)
        members = await trio.to_thread.run_sync(self._group_members, record)
        if not members:
            return
        _signal_group(pgrp, signal.SIGTERM)
        _signal_group(pgrp, signal.SIGCONT)
        with trio.move_on_after(max(timeout, 0.0)):
            while members:
                await trio.sleep(_POLL)
                members = await trio.to_thread.run_sync(self._group_members, record)
        if not members:
            return
        _signal_group(pgrp, signal.SIGKILL)
        with trio.move_on_after(self.kill_grace):
            while members:
                await trio.sleep(_POLL)
                members = await trio.to_thread.run_sync(self._group_members, record)
        if members:
            raise DeadlineExceeded(
                f"unit {name}: processes {', '.join(map(str, members))} survived SIGKILL "
                f"for {self.kill_grace:g}s (stuck in the kernel?)"
            )

    def _forget(self, name: str) -> None:
        path = self._record_path(name)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        atomicfile.fsync_dir(path.parent)


def _signal_group(pgrp: int, sig: signal.Signals) -> None:
    # ProcessLookupError: the group ended between the check and the signal.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgrp, sig)
