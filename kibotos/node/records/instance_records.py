"""The node's records of its Instances: the launch record, the Instance record, and the
registry entry an ended Instance leaves.

``<storage.root>/runtime/instances/<instance_id>/``

* ``systemd.json``, the launch record (spec: node-and-vmm-processes, "Launch records and
  adoption"): written *before* the VMM unit starts, with the launch ID, the unit name,
  the expected command and the launch description; after the start the node adds the
  InvocationID, MainPID, process start time, executable path and dev:ino, cgroup and
  network namespace; after readiness, the guest it accepted (boot ID, capabilities).
  An Instance with a network also has its network there (namespace name and path, tap,
  veth ends, guest MAC, addresses, the slot table, the network record's path).
  A restarted node compares it with the running unit (`unit_matches`).
* ``instance.json``, the node's own Instance record: the create arguments, the state
  and its reason, and the result of the last stop.

``<storage.root>/runtime/registry/<instance_id>.json`` is what remains of a destroyed
Instance (state, when, what was released) until ctrl says it is no longer needed, so a
repeated command about it still gets the same answer.

Every write goes through `kibotos.core.atomicfile`: a crash leaves the old record or the new.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kibotos.backends import UnitInfo
from kibotos.core import atomicfile
from kibotos.core.errors import FailedPrecondition

FORMAT = 1
LAUNCH_RECORD = "systemd.json"
INSTANCE_RECORD = "instance.json"


def now_iso() -> str:
    return datetime.now(UTC).isoformat()


def _read(path: Path) -> dict[str, Any] | None:
    value = atomicfile.read_json_object_if_present(
        path, lambda exc: f"unreadable record {path}: {exc}",
        f"record {path} is not a JSON object")
    if value is None:
        return None
    if value.get("format") != FORMAT:
        raise FailedPrecondition(f"record {path} has format {value.get('format')!r}; this "
                                 f"node reads format {FORMAT}")
    return value


# ---------------------------------------------------------------------------- launch record


def write_launch_record(instance_dir: Path, *, launch_id: str, instance_id: str,
                        unit_name: str, argv: Sequence[str], supervisor: str, backend: str,
                        launch: Mapping[str, Any],
                        installation: Mapping[str, Any] | None = None,
                        network: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`installation` is the pinned runtime installation (``{identity,
    runtime_version}``, `kibotos.node.runtime.installations`); None where no node pinned one.
    `network` is what the Instance's network consists of (namespace, tap, veth,
    addresses, table: `kibotos.node.instances.network_step.NetworkStep.record_fields`);
    None for an Instance without a network."""
    record: dict[str, Any] = {
        "format": FORMAT,
        "launch_id": launch_id,
        "instance_id": instance_id,
        "unit_name": unit_name,
        "expected_command": [str(a) for a in argv],
        "supervisor": supervisor,
        "backend": backend,
        "launch": dict(launch),
        "installation": dict(installation) if installation is not None else None,
        "network": dict(network) if network is not None else None,
        "written_at": now_iso(),
        "unit": None,
        "guest": None,
    }
    atomicfile.write_json(instance_dir / LAUNCH_RECORD, record, mode=0o600)
    return record


def unit_facts(info: UnitInfo) -> dict[str, Any]:
    return {
        "invocation_id": info.invocation_id,
        "main_pid": info.main_pid,
        "start_time_ticks": info.start_time_ticks,
        "executable": info.executable,
        "executable_dev_ino": list(info.executable_dev_ino)
        if info.executable_dev_ino else None,
        "cgroup": info.cgroup,
        "netns_inode": info.netns_inode,
    }


def add_unit_facts(instance_dir: Path, record: dict[str, Any], info: UnitInfo
                   ) -> dict[str, Any]:
    record = {**record, "unit": {**unit_facts(info), "started_at": now_iso()}}
    atomicfile.write_json(instance_dir / LAUNCH_RECORD, record, mode=0o600)
    return record


def add_guest(instance_dir: Path, record: dict[str, Any], guest: Mapping[str, Any]
              ) -> dict[str, Any]:
    accepted = {"boot_id": guest.get("boot_id"),
                "capabilities": sorted(guest.get("capabilities") or []),
                "protocol_version": guest.get("protocol_version"),
                "agent_version": guest.get("agent_version"),
                "accepted_at": now_iso()}
    record = {**record, "guest": accepted}
    atomicfile.write_json(instance_dir / LAUNCH_RECORD, record, mode=0o600)
    return record


def read_launch_record(instance_dir: Path) -> dict[str, Any] | None:
    return _read(instance_dir / LAUNCH_RECORD)


def unit_matches(record: Mapping[str, Any], info: UnitInfo | None) -> bool:
    """Whether the running unit is the one the record started: same name, invocation,
    MainPID with the same start time, same executable file, cgroup and namespace."""
    unit = record.get("unit")
    if info is None or not info.active or not isinstance(unit, dict):
        return False
    dev_ino = list(info.executable_dev_ino) if info.executable_dev_ino else None
    return (info.name == record.get("unit_name")
            and info.invocation_id == unit.get("invocation_id")
            and info.main_pid == unit.get("main_pid")
            and info.start_time_ticks == unit.get("start_time_ticks")
            and info.executable == unit.get("executable")
            and dev_ino == unit.get("executable_dev_ino")
            and info.cgroup == unit.get("cgroup")
            and info.netns_inode == unit.get("netns_inode"))


# ---------------------------------------------------------------------------- Instance record


def write_instance_record(instance_dir: Path, record: Mapping[str, Any]) -> None:
    atomicfile.write_json(instance_dir / INSTANCE_RECORD,
                          {**record, "format": FORMAT, "updated_at": now_iso()}, mode=0o600)


def read_instance_record(instance_dir: Path) -> dict[str, Any] | None:
    return _read(instance_dir / INSTANCE_RECORD)


# ---------------------------------------------------------------------------- registry


def write_registry_entry(registry: Path, instance_id: str, entry: Mapping[str, Any]) -> None:
    registry.mkdir(parents=True, exist_ok=True)
    atomicfile.write_json(registry / f"{instance_id}.json",
                          {**entry, "format": FORMAT, "instance_id": instance_id}, mode=0o600)


def read_registry_entry(registry: Path, instance_id: str) -> dict[str, Any] | None:
    return _read(registry / f"{instance_id}.json")
