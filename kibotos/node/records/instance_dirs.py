"""The Instances' directories and records on disk, and what a restarted node makes of
them.

``<storage.root>/runtime/instances/<id>/`` holds a live Instance
(`kibotos.node.records.instance_records` describes its files); when the Instance ends
(stopped or destroyed) the directory goes, after the tails of its console and VMM logs
are kept in ``machine-logs/<id>/`` (spec: "Console and VMM logs") and a registry entry
in ``runtime/registry/<id>.json`` (spec: "Records of ended Instances"), which answers
repeated commands about it.

A restarted node reads every Instance record (`InstanceDirs.read_all`) and settles each
against the supervisor (`settle`): a RUNNING Instance whose unit still matches its
launch record is kept running; any other unfinished one becomes FAILED, its VMM (if it
still runs) left alone for a stop with force.  Full adoption (reconfiguring the guest,
runtime installations, the startup refusal on a mismatch) is the next issue's.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trio

from kibotos.backends import Supervisor
from kibotos.core.errors import FailedPrecondition, KibotosError
from kibotos.core.logs import EventLogger
from kibotos.node.host.vmm_access import make_instance_dir
from kibotos.node.instances.contract import CREATING, DESTROYED, FAILED, RUNNING, STOPPED, STOPPING
from kibotos.node.instances.lifecycle import Instance
from kibotos.node.records import instance_records as records
from kibotos.node.records import machine_logs
from kibotos.node.records.registry import Registry, cleanup_result

log = EventLogger()

#: The reason the spec and docs/architecture.md give for a VMM that ended on its own.
EXITED_REASON = "node reports the Instance as no longer running"
#: The node's reason for a VMM the kernel's OOM killer ended.
OOM_REASON = "oom_killed"
#: `UnitInfo.result` values that mean the kernel's OOM killer ended the unit.  systemd
#: reports ``oom-kill``; ``direct`` cannot tell (it reports ``gone``).
OOM_RESULTS = frozenset({"oom-kill"})


class InstanceDirs:
    """Where the node keeps its Instances; every method is blocking (call it in a
    worker thread) except `persist`."""

    def __init__(self, root: Path, *, machine_logs_limit: int = machine_logs.DEFAULT_LIMIT
                 ) -> None:
        self.root = root
        self.instances = root / "runtime" / "instances"
        self.registry = root / "runtime" / "registry"
        self.records = Registry(self.registry)
        self.machine_logs = root / "machine-logs"
        self.machine_logs_limit = machine_logs_limit
        # A copy cut short by a crash left a staging directory: deleted at start, as
        # every local temporary file is (spec: "Temporary files from interrupted writes").
        machine_logs.remove_staging(self.machine_logs)

    def dir_for(self, instance_id: str) -> Path:
        return self.instances / instance_id

    def make(self, inst: Instance) -> None:
        if inst.dir.exists():
            raise FailedPrecondition(f"Instance directory {inst.dir} exists without a record "
                                     "this node knows; left alone")
        make_instance_dir(self.root, inst.dir)  # root:kibotos-vmm 1770: the VMM works in it
        records.write_instance_record(inst.dir, inst.to_record())

    async def persist(self, inst: Instance) -> None:
        if inst.dir.is_dir():
            await trio.to_thread.run_sync(records.write_instance_record, inst.dir,
                                          inst.to_record())

    def ended(self, instance_id: str) -> dict[str, Any] | None:
        """The registry entry of an Instance that ended here, if any."""
        return self.records.read(instance_id)

    def remove(self, inst: Instance) -> None:
        """Keep the log tails (one ``instance machine exited`` line), write the registry
        entry with the cleanup result observed now, delete the directory.  The block
        files live in the pools: they stay.  A repeat after a node restart (the
        directory outlived its entry) keeps what the first pass wrote."""
        kept = self.machine_logs / inst.instance_id
        sizes = machine_logs.keep_tails(inst.dir, kept)
        if sizes is not None:
            removed = machine_logs.enforce_quota(self.machine_logs, self.machine_logs_limit,
                                                 keep=inst.instance_id)
            log.info("instance machine exited", instance=inst.instance_id,
                     workspace=inst.spec.workspace_id, state=inst.state,
                     unit=inst.unit_name, logs=kept,
                     console_bytes=sizes.get("console.log", 0),
                     vmm_bytes=sizes.get("vmm.log", 0),
                     quota_removed=len(removed) or None)
        if self.records.read(inst.instance_id) is None:
            ended = records.now_iso()
            self.records.write(inst.instance_id, {
                "workspace_id": inst.spec.workspace_id, "state": inst.state,
                "reason": inst.reason, "confirmed_on_disk": bool(inst.confirmed_on_disk),
                "released": [h.to_json() for h in inst.held], "ended_at": ended,
                "cleanup": cleanup_result(ended)})
        shutil.rmtree(inst.dir)

    def read_all(self) -> list[Instance]:
        """The Instances a previous node process left; an ended one whose removal was
        cut short is removed now; a directory without a readable record is left alone."""
        try:
            dirs = sorted(p for p in self.instances.iterdir() if p.is_dir())
        except FileNotFoundError:
            return []
        found = []
        for d in dirs:
            try:
                rec = records.read_instance_record(d)
                if rec is None:
                    log.warning("Instance directory without a record: left alone", path=d)
                    continue
                inst = Instance.from_record(d, rec)
            except (KibotosError, KeyError, ValueError) as exc:
                log.error("unreadable Instance record: left alone", path=d, error=str(exc))
                continue
            if inst.state in (STOPPED, DESTROYED):
                self.remove(inst)
                continue
            found.append(inst)
        return found


def fill_from_launch(inst: Instance, launch: Mapping[str, Any] | None) -> None:
    """The node may have died before ``instance.json`` caught up with the launch
    record: the unit name, launch description and main process come from there."""
    if launch is None:
        return
    inst.unit_name = inst.unit_name or launch.get("unit_name")
    inst.launch = inst.launch or launch.get("launch")
    unit = launch.get("unit") or {}
    if inst.main_process is None and isinstance(unit.get("main_pid"), int) and \
            isinstance(unit.get("start_time_ticks"), int):
        inst.main_process = (unit["main_pid"], unit["start_time_ticks"])


async def settle(inst: Instance, supervisor: Supervisor) -> bool:
    """Compare a reloaded live Instance with its unit; True when it runs as recorded,
    else the Instance is now FAILED (persist it).  FAILED ones stay as they are."""
    if inst.state not in (RUNNING, CREATING, STOPPING):
        return False
    launch = await trio.to_thread.run_sync(records.read_launch_record, inst.dir)
    fill_from_launch(inst, launch)
    info = await supervisor.describe(inst.unit_name) if inst.unit_name else None
    if inst.state == RUNNING and launch is not None and records.unit_matches(launch, info):
        return True
    if info is not None and info.active:
        reason = (f"node restarted while the Instance was {inst.state}; its VMM still runs "
                  "and was not taken over: stop it with force")
    else:
        reason = EXITED_REASON
    log.error("instance not taken over", instance=inst.instance_id, state=inst.state,
              reason=reason)
    inst.state, inst.reason = FAILED, reason
    return False
