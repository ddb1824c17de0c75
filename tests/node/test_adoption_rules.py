"""The start-up comparison table of `kibotos.node.instances.adoption.judge`, row by row, on
records and unit descriptions as the supervisor reports them (no processes needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kibotos.backends import UnitInfo
from kibotos.node.instances.adoption import (
    ADOPT,
    FINISH,
    GONE,
    LEAVE,
    REBOOT,
    STOPPING_KEPT,
    differences,
    judge,
)
from kibotos.node.instances.contract import CREATING, FAILED, RUNNING, STOPPING
from kibotos.node.instances.lifecycle import Instance
from kibotos.protocol import CreateSpec

NAME = "kibotos-vmm-inst-1.service"
ARGV = ["/usr/bin/vmm", "--socket", "/r/runtime/instances/inst-1/agent.sock"]
DIGEST = "sha256:" + "a" * 64


def instance(state: str) -> Instance:
    spec = CreateSpec.model_validate({
        "instance_id": "inst-1", "workspace_id": "ws-1",
        "template": {"name": "t", "image_digest": DIGEST, "kernel_digest": DIGEST,
                     "initramfs_digest": DIGEST},
        "cpu_millis": 1000, "memory_bytes": 256 << 20,
        "layer": {"pool_id": "pool-a", "ref": "ws-1", "capacity_bytes": 64 << 20,
                  "epoch": 1, "create": True},
        "volumes": [], "launch": {"hostname": "h", "env": {}}})
    return Instance(spec=spec, dir=Path("/nonexistent"), state=state, unit_name=NAME)


def unit(**change: Any) -> UnitInfo:
    facts: dict[str, Any] = {
        "name": NAME, "active": True, "invocation_id": "f" * 32, "main_pid": 4242,
        "start_time_ticks": 777, "executable": "/usr/bin/vmm",
        "executable_dev_ino": (1, 2), "cgroup": "/kibotos.slice/x", "netns_inode": 9,
        "argv": tuple(ARGV)}
    facts.update(change)
    return UnitInfo(**facts)


def record(with_facts: bool = True, **change: Any) -> dict[str, Any]:
    facts = {"invocation_id": "f" * 32, "main_pid": 4242, "start_time_ticks": 777,
             "executable": "/usr/bin/vmm", "executable_dev_ino": [1, 2],
             "cgroup": "/kibotos.slice/x", "netns_inode": 9, **change}
    return {"format": 1, "launch_id": "lch-1", "instance_id": "inst-1", "unit_name": NAME,
            "expected_command": list(ARGV), "unit": facts if with_facts else None}


GONE_UNIT = unit(active=False, main_pid=None, start_time_ticks=None, executable=None,
                 executable_dev_ino=None, cgroup=None, netns_inode=None, result="gone")


@pytest.mark.parametrize(("state", "launch", "info", "action"), [
    (RUNNING, record(), unit(), ADOPT),
    (RUNNING, record(), GONE_UNIT, GONE),
    (RUNNING, record(), None, GONE),
    (CREATING, record(), unit(), FINISH),
    # a wrapper exec'd the VMM proper before readiness: the process facts decide
    (CREATING, record(executable="/usr/bin/python3", executable_dev_ino=[1, 9]), unit(),
     FINISH),
    (CREATING, record(with_facts=False), unit(), FINISH),  # the launch response was lost
    (CREATING, record(with_facts=False), None, REBOOT),
    (CREATING, None, None, REBOOT),
    (CREATING, record(), GONE_UNIT, REBOOT),
    (STOPPING, record(), unit(), STOPPING_KEPT),
    (STOPPING, record(), None, STOPPING_KEPT),
    (STOPPING, None, None, STOPPING_KEPT),
    (FAILED, record(), unit(), LEAVE),
    (FAILED, record(invocation_id="0" * 32), unit(), LEAVE),  # checked at reclaim
])
def test_verdicts(state: str, launch: dict[str, Any] | None, info: UnitInfo | None,
                  action: str) -> None:
    verdict, problem = judge(instance(state), launch, info)
    assert problem is None
    assert verdict.action == action


@pytest.mark.parametrize(("state", "launch", "info", "says"), [
    (RUNNING, record(invocation_id="0" * 32), unit(), "invocation_id recorded"),
    (RUNNING, record(executable_dev_ino=[1, 3]), unit(), "executable_dev_ino recorded"),
    (RUNNING, record(cgroup="/other"), unit(), "cgroup recorded '/other'"),
    (RUNNING, record(with_facts=False), unit(), "launch record has no unit facts"),
    (RUNNING, None, None, "no launch record with unit facts"),
    (CREATING, record(main_pid=1), unit(), "main_pid recorded 1, running 4242"),
    (CREATING, record(with_facts=False), unit(argv=("/bin/other",)),
     "is not the launch of record lch-1"),
    # a process that started long before the record was written is not its launch
    (CREATING, {**record(with_facts=False), "written_at": "2999-01-01T00:00:00+00:00"},
     unit(), "started before the record was written"),
    (CREATING, None, unit(), "runs but no launch record was written"),
    (STOPPING, record(start_time_ticks=1), unit(), "start_time_ticks recorded 1"),
])
def test_mismatches_refuse_the_start(state: str, launch: dict[str, Any] | None,
                                     info: UnitInfo, says: str) -> None:
    _, problem = judge(instance(state), launch, info)
    assert problem is not None
    assert says in problem


def test_differences_name_the_unit() -> None:
    assert differences(record(), unit(name="kibotos-vmm-other.service")) == [
        f"unit name recorded {NAME!r}, running 'kibotos-vmm-other.service'"]
