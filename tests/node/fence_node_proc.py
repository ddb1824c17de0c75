"""A node's Instance manager in its own process, driven over stdin/stdout: the fencing
tests run two of these on one shared pool directory and stop one with SIGSTOP.

    python fence_node_proc.py BASE NODE_ID POOL RECEIPT_WAIT

It runs the real `VmInstanceManager` (``direct`` supervisor, ``testvmm`` backend with
``write_records``, so every "VM" keeps writing to its Volumes), with its real holder
check every 5 s and no ctrl at all.  stdin: one JSON command per line,
``{"kind": "instance.create", "args": {...}}``; stdout: one JSON line per answer
(``{"reply": ...}`` or ``{"error": ...}``) and per published ``instance_state`` frame
(``{"frame": ...}``).  At stdin's end every unit is stopped and the process exits.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import trio
from instance_harness import FAST, node_config, registries, stop_all_units, write_template

from kibotos.core.errors import KibotosError
from kibotos.node.instances.setup import build_instance_manager


def emit(value: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(value) + "\n")
    sys.stdout.flush()


async def main(base: Path, node_id: str, pool: Path, receipt_wait: float) -> None:
    config = node_config(base, shared=True, node_id=node_id, pool=pool,
                         backend_options="write_records = true")
    for sub in ("runtime", "template-cache", "machine-logs"):
        (config.storage.root / sub).mkdir(parents=True, exist_ok=True)
    write_template(base)
    manager = build_instance_manager(config, memory_tight=lambda: False,
                                     registries=registries(), settings=FAST,
                                     receipt_wait=receipt_wait)

    async def frames() -> None:
        feed, seen = manager.state_feed(), 0
        while True:
            seen, got = await feed.after(seen)
            for frame in got:
                emit({"frame": frame})

    async def command(line: bytes) -> None:
        request = json.loads(line)
        try:
            reply = await manager.command_handlers()[request["kind"]](request["args"])
        except KibotosError as exc:
            emit({"error": exc.message, "kind": request["kind"]})
        else:
            emit({"reply": reply, "kind": request["kind"]})

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(manager.run)
            nursery.start_soon(frames)
            emit({"started": node_id, "pid": os.getpid()})
            stdin = trio.lowlevel.FdStream(os.dup(0))
            buffer = b""
            while True:
                data = await stdin.receive_some()
                if not data:
                    break
                buffer += data
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        nursery.start_soon(command, line)
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await stop_all_units(config)


if __name__ == "__main__":
    trio.run(main, Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), float(sys.argv[4]))
