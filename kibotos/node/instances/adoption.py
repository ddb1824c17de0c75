"""Adoption at node start: the launch records compared with the units that really run.

Spec: node-and-vmm-processes, "Launch records and adoption".  A restarted node must
not guess which process belongs to which Instance.  `examine` reads every Instance's
records (``instance.json`` and the launch record ``systemd.json``) and the supervisor's
units named ``kibotos-vmm-*`` (one listing), and decides for each Instance:

============  =================================================================
``adopt``     RUNNING, and its unit runs as recorded (name, InvocationID, MainPID
              with its start time, executable path and dev:ino, cgroup, network
              namespace): it runs on; storage and the guest are taken over in the
              background (`kibotos.node.instances.adoption_background`), the guest is not waited for
``finish``    CREATING, and its unit runs as recorded, or the launch response was
              lost (record written, unit started, facts not recorded) and the unit
              found by its name runs the recorded command and started after the
              record was written: its facts are recorded now, and readiness is still
              awaited (creation fails on timeout)
``reboot``    CREATING, and no VMM runs for it: it is launched again
``stopping``  STOPPING: kept as is; the stop that ctrl repeats finishes it
``gone``      RUNNING, but its VMM ended while the node was away: FAILED with the
              spec's reason, resources kept until stopped with force or destroyed
``leave``     FAILED: left as it is, its VMM (if any) untouched until reclaimed
============  =================================================================

Startup is refused (`AdoptionRefused`, nothing written) when a record does not match
reality: a live unit whose facts differ from its launch record, a RUNNING Instance
without launch facts, a record that cannot be read, or a live ``kibotos-vmm-*`` unit of
this node with no Instance record at all.  A unit is this node's when the supervisor
keeps its units per node (``direct``: a state directory per storage root) or when its
command line names this node's Instance directory (systemd's units are host-wide).

`check_ownership` guards reclaiming an Instance that was not adopted but whose unit
still runs: the launch record, the unit binding, the node's own Instance record and
the actual unit must all name the same process, or the stop is refused with ``stop
instance process this node did not take over`` and the unit keeps running.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import trio

from kibotos.backends import Supervisor, UnitInfo
from kibotos.core import atomicfile, procfs
from kibotos.core.errors import FailedPrecondition, KibotosError
from kibotos.core.logs import EventLogger
from kibotos.node.instances.adoption_background import SetState, Takeover
from kibotos.node.instances.contract import CREATING, FAILED, RUNNING, STOPPING
from kibotos.node.instances.lifecycle import Instance, unit_name_for
from kibotos.node.records import instance_records as records
from kibotos.node.records.instance_dirs import (
    EXITED_REASON,
    OOM_REASON,
    OOM_RESULTS,
    fill_from_launch,
)

log = EventLogger()

#: The name prefix of every VMM unit (`kibotos.node.instances.lifecycle.unit_name_for`).
VMM_PREFIX = "kibotos-vmm-"
#: The unit facts compared between the launch record and the running unit.
FACTS = ("invocation_id", "main_pid", "start_time_ticks", "executable",
         "executable_dev_ino", "cgroup", "netns_inode")
#: The facts an exec leaves alone: a backend may start its VMM through a wrapper that
#: execs it (qemu's no-THP wrapper), so until the guest is ready only these prove the
#: process; the executable is recorded again at readiness (`facts_at_readiness`).
PROCESS_FACTS = ("invocation_id", "main_pid", "start_time_ticks", "cgroup", "netns_inode")
#: The error of a refused reclaim (spec: Troubleshooting).
NOT_TAKEN_OVER = "stop instance process this node did not take over"

ADOPT, FINISH, REBOOT, STOPPING_KEPT, GONE, LEAVE = (
    "adopt", "finish", "reboot", "stopping", "gone", "leave")


class AdoptionRefused(FailedPrecondition):
    """The records on disk do not match the units that run: the node does not start,
    because anything it did next could act on a process that is not what it thinks."""


@dataclass
class Verdict:
    """What the restarted node does with one Instance (see the module table)."""

    inst: Instance
    action: str
    info: UnitInfo | None = None
    launch: dict[str, Any] | None = None


def differences(record: Mapping[str, Any], info: UnitInfo, facts: Sequence[str] = FACTS
                ) -> list[str]:
    """The recorded unit facts that differ from the running unit, as readable text."""
    unit = record.get("unit") or {}
    now = records.unit_facts(info)
    out = [f"{key} recorded {unit.get(key)!r}, running {now[key]!r}"
           for key in facts if unit.get(key) != now[key]]
    if info.name != record.get("unit_name"):
        out.insert(0, f"unit name recorded {record.get('unit_name')!r}, running {info.name!r}")
    return out


def _runs_recorded_command(record: Mapping[str, Any], info: UnitInfo) -> bool:
    expected = record.get("expected_command")
    return bool(info.argv) and isinstance(expected, list) and list(info.argv) == expected


def _started_before_record(record: Mapping[str, Any], info: UnitInfo) -> bool:
    """Whether the unit's main process is older than the launch record: then it is
    not the launch the record describes (a unit started *after* the record is).  The
    boot time is in whole seconds, hence the second of slack."""
    written, ticks, boot = record.get("written_at"), info.start_time_ticks, procfs.boot_time()
    if not isinstance(written, str) or ticks is None or boot is None:
        return False
    try:
        at = datetime.fromisoformat(written).timestamp()
    except ValueError:
        return False
    return boot + ticks / procfs.CLK_TCK < at - 1.0


def owns_unit(info: UnitInfo, supervisor: Supervisor, instances_dir: Path) -> bool:
    """Whether a ``kibotos-vmm-*`` unit is this node's: every unit of a ``direct``
    supervisor is (its state directory is per storage root); systemd's units are
    host-wide, so there one is this node's when its command line names this node's
    Instance directory (several nodes may share a host; check-maintenance uses it too)."""
    if supervisor.name == "direct":
        return True
    root = str(instances_dir) + "/"
    return any(root in arg for arg in info.argv)


def judge(inst: Instance, launch: dict[str, Any] | None, info: UnitInfo | None
          ) -> tuple[Verdict, str | None]:
    """The verdict for one Instance, and the mismatch that refuses startup (or None)."""
    live = info is not None and info.active
    what = f"Instance {inst.instance_id} ({inst.state})"
    if inst.state == FAILED:
        return Verdict(inst, LEAVE, info, launch), None
    if inst.state == CREATING:
        if not live:
            return Verdict(inst, REBOOT, info, launch), None
        assert info is not None
        if launch is None:
            return Verdict(inst, LEAVE, info), (
                f"{what}: unit {info.name} runs but no launch record was written")
        if launch.get("unit") is None:  # the launch response was lost
            if info.name == launch.get("unit_name") and _runs_recorded_command(launch, info) \
                    and not _started_before_record(launch, info):
                return Verdict(inst, FINISH, info, launch), None
            return Verdict(inst, LEAVE, info, launch), (
                f"{what}: unit {info.name} is not the launch of record "
                f"{launch.get('launch_id')} (another command, or started before the record "
                "was written)")
    if launch is None or launch.get("unit") is None:
        if inst.state == STOPPING and not live:
            return Verdict(inst, STOPPING_KEPT, info, launch), None
        if not live and inst.state == RUNNING:
            return Verdict(inst, LEAVE, info, launch), (
                f"{what}: no launch record with unit facts")
        return Verdict(inst, LEAVE, info, launch), (
            f"{what}: unit {inst.unit_name} runs but its launch record has no unit facts")
    if not live:
        return Verdict(inst, STOPPING_KEPT if inst.state == STOPPING else
                       REBOOT if inst.state == CREATING else GONE, info, launch), None
    assert info is not None
    diff = differences(launch, info, PROCESS_FACTS if inst.state == CREATING else FACTS)
    if diff:
        return Verdict(inst, LEAVE, info, launch), (
            f"{what}: unit {info.name} does not match launch record "
            f"{launch.get('launch_id')}: {'; '.join(diff)}")
    action = {RUNNING: ADOPT, CREATING: FINISH, STOPPING: STOPPING_KEPT}[inst.state]
    return Verdict(inst, action, info, launch), None


async def examine(insts: Sequence[Instance], supervisor: Supervisor, instances_dir: Path
                  ) -> tuple[list[Verdict], list[UnitInfo]]:
    """Verdicts for every reloaded Instance, and the dead units of this node that no
    Instance names (leftover names to forget); raises `AdoptionRefused` listing every
    mismatch.  Writes nothing."""
    units = {u.name: u for u in await supervisor.list(VMM_PREFIX)}

    def read_all() -> list[tuple[dict[str, Any] | None, str | None]]:
        out: list[tuple[dict[str, Any] | None, str | None]] = []
        for inst in insts:
            try:
                out.append((records.read_launch_record(inst.dir), None))
            except KibotosError as exc:
                out.append((None, exc.message))
        return out

    launches = await trio.to_thread.run_sync(read_all)
    problems: list[str] = []
    verdicts: list[Verdict] = []
    claimed: set[str] = set()
    for inst, (launch, unreadable) in zip(insts, launches, strict=True):
        fill_from_launch(inst, launch)
        name = inst.unit_name or unit_name_for(inst.instance_id)
        claimed.add(name)
        info = units.get(name)
        if unreadable is not None:
            problems.append(f"Instance {inst.instance_id}: {unreadable}")
            continue
        verdict, problem = judge(inst, launch, info)
        if problem is not None:
            problems.append(problem)
        verdicts.append(verdict)
    leftovers = []
    for name, info in sorted(units.items()):
        if name in claimed or not owns_unit(info, supervisor, instances_dir):
            continue
        if info.active:
            problems.append(f"unit {name} (MainPID {info.main_pid}, invocation "
                            f"{info.invocation_id}) runs with no Instance record")
        else:
            leftovers.append(info)
    if problems:
        for problem in problems:
            log.error("launch record does not match the running unit", problem=problem)
        raise AdoptionRefused(
            f"node startup refused: {len(problems)} launch record(s) do not match the "
            f"running VMM units: {' | '.join(problems)}. Keep the records; inspect the "
            "units with systemctl show/journalctl -u (or the direct supervisor's records) "
            "and stop only a unit you confirmed, then start the node again",
            details={"problems": problems})
    return verdicts, leftovers


async def check_ownership(inst: Instance, supervisor: Supervisor) -> None:
    """Refuse to reclaim an Instance this node did not take over unless the launch
    record, the unit binding, the node's Instance record and the running unit all name
    the same process; a unit that no longer runs needs no proof."""
    name = inst.unit_name or unit_name_for(inst.instance_id)
    info = await supervisor.describe(name)
    if info is None or not info.active:
        return

    def read() -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        return records.read_launch_record(inst.dir), records.read_instance_record(inst.dir)

    problems: list[str] = []
    try:
        launch, own = await trio.to_thread.run_sync(read)
    except KibotosError as exc:
        launch, own = None, None
        problems.append(exc.message)
    if launch is None:
        problems.append("the launch record systemd.json is missing or unreadable")
    else:
        if launch.get("instance_id") != inst.instance_id:
            problems.append(f"the launch record is for Instance {launch.get('instance_id')}")
        if launch.get("unit") is None:
            problems.append("the launch record has no unit facts")
        else:
            problems.extend(differences(launch, info))
        if not _runs_recorded_command(launch, info):
            problems.append("the unit's command is not the launch record's")
    if own is None:
        problems.append("the node's Instance record instance.json is missing or unreadable")
    else:
        main = own.get("main_process")
        if own.get("unit_name") not in (None, name):
            problems.append(f"the node's Instance record binds unit {own.get('unit_name')}")
        if not main or [info.main_pid, info.start_time_ticks] != list(main):
            problems.append(f"the node's Instance record binds process {main}, the unit's "
                            f"is {[info.main_pid, info.start_time_ticks]}")
    if problems:
        log.error("instance reclaim refused", instance=inst.instance_id, unit=name,
                  main_pid=info.main_pid, problems="; ".join(problems))
        raise FailedPrecondition(
            f"{NOT_TAKEN_OVER}: unit {name} (MainPID {info.main_pid}) of Instance "
            f"{inst.instance_id}: {'; '.join(problems)}; the unit keeps running. Inspect it "
            "with systemctl show and journalctl -u, stop only that unit once confirmed, "
            "then retry with the same command ID",
            details={"reason": "not_taken_over", "unit": name, "problems": problems})


async def carry_out(verdicts: Sequence[Verdict], leftovers: Sequence[UnitInfo], *,
                    supervisor: Supervisor, takeover: Takeover, nursery: trio.Nursery,
                    set_state: SetState, publish: Callable[[Instance], None],
                    boot: Callable[[Instance], Awaitable[None]]) -> bool:
    """Act on the verdicts of `examine` (nothing here waits for a guest); True when a
    VMM of this node runs."""
    start = trio.current_time()
    for dead in leftovers:  # a dead unit no Instance names: only its name is left
        await supervisor.stop(dead.name, timeout=1.0)
    counts: dict[str, int] = {}
    live = False
    for verdict in verdicts:
        inst, info = verdict.inst, verdict.info
        counts[verdict.action] = counts.get(verdict.action, 0) + 1
        active = info is not None and info.active
        live = live or active
        if verdict.action == ADOPT:
            inst.guest = {**(inst.guest or {}), "responding": False}
            publish(inst)
            nursery.start_soon(takeover.adopt, inst, verdict.launch)
        elif verdict.action == FINISH:
            assert info is not None
            assert verdict.launch is not None
            if verdict.launch.get("unit") is None:
                log.warning("instance launch response was lost: the unit found by its name "
                            "runs the recorded command; its facts are recorded now",
                            instance=inst.instance_id, unit=info.name,
                            main_pid=info.main_pid, launch_id=verdict.launch.get("launch_id"))
                await trio.to_thread.run_sync(records.add_unit_facts, inst.dir,
                                              verdict.launch, info)
                assert info.main_pid is not None
                assert info.start_time_ticks is not None
                inst.main_process = (info.main_pid, info.start_time_ticks)
            nursery.start_soon(takeover.finish_boot, inst)
        elif verdict.action == REBOOT:
            log.warning("instance launched again: the node restarted while it was created "
                        "and no VMM runs for it", instance=inst.instance_id)
            nursery.start_soon(boot, inst)
        elif verdict.action == GONE:
            # Killed by the host's OOM killer while the node was away, and systemd still
            # has the failed unit: said as such, so ctrl stops the Workspace on its own
            # (spec Troubleshooting); a unit systemd already removed cannot tell.
            reason = OOM_REASON if info is not None and info.result in OOM_RESULTS \
                else EXITED_REASON
            log.error("instance not taken over", instance=inst.instance_id,
                      state=inst.state, reason=reason)
            await set_state(inst, FAILED, reason)
        elif verdict.action == LEAVE and active:
            takeover.not_taken_over.add(inst.instance_id)
    if verdicts or leftovers:
        log.info("instances reloaded", count=len(verdicts), **counts,
                 forgotten_units=len(leftovers),
                 elapsed_ms=round((trio.current_time() - start) * 1000, 1))
    return live


async def facts_at_readiness(inst: Instance, supervisor: Supervisor) -> dict[str, Any]:
    """The launch record once the guest is ready, with the unit's facts read again: the
    process that started may since have exec'd the VMM proper (a wrapper), and from
    readiness on the record must name what runs.  It must still be the same process
    (`PROCESS_FACTS`); anything else fails the boot."""
    record = await trio.to_thread.run_sync(records.read_launch_record, inst.dir) or {}
    name = inst.unit_name
    if name is None or not record.get("unit"):
        return record
    info = await supervisor.describe(name)
    if info is None or not info.active:
        return record  # the watcher and the next look at the unit deal with its end
    changed = differences(record, info, PROCESS_FACTS)
    if changed:
        raise FailedPrecondition(f"the VMM unit {name} is no longer the process it started "
                                 f"as: {'; '.join(changed)}")
    if differences(record, info):
        record = {**record, "unit": {**record["unit"], **records.unit_facts(info)}}
        await trio.to_thread.run_sync(lambda: atomicfile.write_json(
            inst.dir / records.LAUNCH_RECORD, record, mode=0o600))
    return record
