"""Crash consistency of the pool records: a node process killed with SIGKILL at every
record write and rename point of an object step (open/create, takeover, release, the
holder check's receipt) leaves no torn record, and after a restart (its temporary
files swept, the step retried as ctrl retries it) the object opens again at the right
epoch with the handoff recorded correctly.

Each case names a failpoint (`kibotos.core.failpoints`; ``@N`` is its N-th hit in the
process) and the test insists the process really died there, so a point the step no
longer passes fails the test instead of passing silently.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from instance_harness import short_dir

from kibotos.core import atomicfile
from kibotos.node.storage.objects import VOLUMES, PoolObjects
from kibotos.node.storage.pools.dirs import prepare_pool_dirs
from kibotos.node.storage.pools.marker import init_pool
from kibotos.node.storage.pools.tempfiles import is_temp_name

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("crash_objects_proc.py")
MIB = 1 << 20
ATOMIC = ("atomic.before-fsync", "atomic.before-rename", "atomic.after-rename")


def objects(pool: Path, node: str) -> PoolObjects:
    return PoolObjects("pool-a", pool, VOLUMES, node, receipt_wait=30)


async def nothing(pool: Path) -> None:
    return None


async def created_by_a(pool: Path) -> None:
    await objects(pool, "node-a").open("vol-1", 1, create_capacity=16 * MIB)


async def released_by_a(pool: Path) -> None:
    await created_by_a(pool)
    assert objects(pool, "node-a").release("vol-1", 1, confirmed_on_disk=True)


async def taken_by_b(pool: Path) -> None:
    """node-a holds epoch 1 and never released; node-b wrote its holder at epoch 2."""
    await created_by_a(pool)
    await objects(pool, "node-b").take("vol-1", 2, may_create=False)


#: step name -> (setup, node, epoch, how many atomic writes the step makes, named points)
STEPS: dict[str, tuple[Callable[[Path], Awaitable[None]], str, int, int, tuple[str, ...]]] = {
    "create": (nothing, "node-a", 1, 3, ("objects.take.after-holder",
                                         "objects.create.after-metadata",
                                         "objects.create.after-data")),
    "takeover": (released_by_a, "node-b", 2, 2, ("objects.take.after-holder",)),
    "release": (created_by_a, "node-a", 1, 2, ("objects.release.after-metadata",)),
    "fence": (taken_by_b, "node-a", 1, 1, ("objects.fence.before-receipt",)),
}
DRIVER_STEP = {"create": "open", "takeover": "open", "release": "release", "fence": "fence"}


def cases() -> Iterator[Any]:
    for step, (_, _, _, writes, named) in STEPS.items():
        for n in range(1, writes + 1):
            for point in ATOMIC:
                yield pytest.param(step, f"{point}=kill@{n}", id=f"{step}-{point}@{n}")
        for point in named:
            yield pytest.param(step, f"{point}=kill", id=f"{step}-{point}")


def run_driver(pool: Path, node: str, step: str, epoch: int, *, failpoint: str | None,
               restart: bool = False) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KIBOTOS_FAILPOINTS"}
    if failpoint is not None:
        env["KIBOTOS_FAILPOINTS"] = failpoint
    argv = [sys.executable, str(DRIVER), str(pool), node, DRIVER_STEP[step], str(epoch)]
    return subprocess.run(argv + (["--restart"] if restart else []), env=env, text=True,
                          capture_output=True, timeout=120, check=False)


def records_all_whole(pool: Path) -> dict[str, dict[str, Any]]:
    """Every record present parses as a JSON object (torn ones would not)."""
    out = {}
    for sub in ("metadata", "holders", "releases"):
        for path in sorted((pool / VOLUMES / sub).iterdir()):
            if path.name.startswith("."):
                continue
            value = atomicfile.read_json(path)
            assert isinstance(value, dict), path
            out[sub] = value
    return out


def temp_files(pool: Path) -> list[Path]:
    return [p for p in pool.rglob(".*") if p.is_file() and is_temp_name(p.name)]


@pytest.fixture
def pool() -> Iterator[Path]:
    path = short_dir("kcr-")
    init_pool("pool-a", path, adopt=True)
    prepare_pool_dirs("pool-a", path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize(("step", "failpoint"), list(cases()))
async def test_killed_at_a_record_point_recovers(pool: Path, step: str, failpoint: str
                                                 ) -> None:
    setup, node, epoch, _, _ = STEPS[step]
    await setup(pool)

    crashed = await trio.to_thread.run_sync(lambda: run_driver(
        pool, node, step, epoch, failpoint=failpoint))
    assert crashed.returncode == -signal.SIGKILL, (crashed.returncode, crashed.stderr)
    records_all_whole(pool)  # no torn record, whatever the point
    if failpoint.startswith(("atomic.before-fsync", "atomic.before-rename")):
        assert [p for p in temp_files(pool) if p.name.startswith(f".{node}.")]  # its temp
    # A neighbour's leftover in this shared pool: not this node's to delete.
    neighbours = pool / VOLUMES / "holders" / ".node-z.vol-1-77.tmp"
    neighbours.write_text("{")

    again = await trio.to_thread.run_sync(lambda: run_driver(
        pool, node, step, epoch, failpoint=None, restart=True))
    assert again.returncode == 0, again.stderr
    # The restarted node swept its own leftovers, and only those (shared pool).
    assert temp_files(pool) == [neighbours]
    neighbours.unlink()
    recs = records_all_whole(pool)
    meta = recs["metadata"]
    assert (meta["id"], meta["capacity_bytes"]) == ("vol-1", 16 * MIB)
    assert (pool / VOLUMES / "data" / "vol-1.ext4").stat().st_size == 16 * MIB

    if step == "create":
        assert recs["holders"]["node_id"] == "node-a"
        assert (meta["state"], meta["holder"], meta["epoch"]) == ("attached", "node-a", 1)
        reopened = await objects(pool, "node-a").open("vol-1", 1)  # a retry opens directly
        assert reopened.handoff_clean is None
        assert not reopened.created
    elif step == "takeover":
        assert (recs["holders"]["node_id"], recs["holders"]["epoch"]) == ("node-b", 2)
        assert (meta["state"], meta["holder"], meta["epoch"]) == ("attached", "node-b", 2)
        assert meta["handoff_clean"] is True  # node-a had released; the retry knows it
    elif step == "release":
        assert (meta["state"], meta["released_cleanly"]) == ("released", True)
        assert (recs["releases"]["node_id"], recs["releases"]["epoch"]) == ("node-a", 1)
        taken = await objects(pool, "node-b").open("vol-1", 2)
        assert taken.handoff_clean is True  # False if it had to wait out the 30 s
    else:  # fence: node-a's receipt lets node-b finish its takeover at epoch 2
        assert (recs["releases"]["node_id"], recs["releases"]["epoch"]) == ("node-a", 1)
        assert recs["releases"]["successor"] == {"node_id": "node-b", "epoch": 2}
        taken = await objects(pool, "node-b").open("vol-1", 2)
        assert taken.handoff_clean is True
        assert records_all_whole(pool)["metadata"]["epoch"] == 2
