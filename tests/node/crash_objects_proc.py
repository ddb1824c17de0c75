"""One pool-object step of a node in its own process, for the crash tests: run with
``KIBOTOS_FAILPOINTS=<point>=kill[@N]`` it dies by SIGKILL at that point; run again
with ``--restart`` it first does what a restarted node does to a pool (its own
temporary files swept, `kibotos.node.storage.pools.tempfiles`) and then retries the step, as
ctrl retries the command.

    python crash_objects_proc.py POOL NODE_ID STEP EPOCH [--restart]

STEP: ``open`` (take over or create the Volume ``vol-1`` at EPOCH), ``release`` (the
normal detach at EPOCH), ``fence`` (the holder check's receipt for EPOCH, the holder
record naming a newer epoch).
"""

from __future__ import annotations

import sys
from pathlib import Path

import trio

from kibotos.node.storage.objects import VOLUMES, PoolObjects
from kibotos.node.storage.pools.tempfiles import sweep_pool

MIB = 1 << 20


async def main(pool: Path, node_id: str, step: str, epoch: int, restart: bool) -> None:
    if restart:
        sweep_pool(pool, shared=True, node_id=node_id)
    objs = PoolObjects("pool-a", pool, VOLUMES, node_id, receipt_wait=30)
    if step == "open":
        opened = await objs.open("vol-1", epoch, create_capacity=16 * MIB)
        print(f"opened clean={opened.handoff_clean} created={opened.created}")
    elif step == "release":
        assert objs.release("vol-1", epoch, confirmed_on_disk=True)
    elif step == "fence":
        successor = objs.taken_over("vol-1", epoch)
        assert successor is not None, "the fence step needs a newer holder"
        assert objs.fence("vol-1", epoch, successor=successor)
    else:
        raise SystemExit(f"unknown step {step}")


if __name__ == "__main__":
    trio.run(main, Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]),
             "--restart" in sys.argv[5:])
