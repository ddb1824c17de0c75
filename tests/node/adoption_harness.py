"""Restarting a node's Instance manager over the same storage root, for the adoption
tests, the kill matrix and bench/adopt.py: like `instance_harness.running_node`, plus
what adoption needs to be driven (a pool-availability function, the manager adjusted
before `run`, a start that is expected to fail) and a child-process node that can be
SIGKILLed at a failpoint."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from instance_harness import (
    FAST,
    TESTPLUGINS,
    Node,
    node_config,
    registries,
    short_dir,
    stop_all_units,
    write_template,
)

from kibotos.node.instances.lifecycle import Settings
from kibotos.node.instances.manager import VmInstanceManager
from kibotos.node.instances.setup import build_instance_manager

HERE = Path(__file__).resolve().parent


def build_node(base: Path, *, settings: Settings = FAST,
               pool_unavailable: Callable[[str], str | None] | None = None,
               short_guest_waits: bool = True, extra: str = "", node_extra: str = ""
               ) -> Node:
    """A manager over `base` (a fresh or a previous node's root), not started yet;
    `short_guest_waits` shortens the guest attempts of the takeover (`quick`); `extra`
    and `node_extra` add to the config (`instance_harness.node_config`)."""
    config = node_config(base, extra=extra, node_extra=node_extra)
    for sub in ("runtime", "template-cache", "machine-logs"):
        (config.storage.root / sub).mkdir(parents=True, exist_ok=True)
    template = write_template(base)
    tight = [False]
    manager = build_instance_manager(config, memory_tight=lambda: tight[0],
                                     registries=registries(), settings=settings,
                                     receipt_wait=1.0, pool_unavailable=pool_unavailable)
    if short_guest_waits:
        quick(manager)
    return Node(base, config, manager, template, tight)


def quick(manager: VmInstanceManager) -> None:
    """Short guest attempts and backoff, so a test waits seconds, not minutes."""
    manager.takeover.attempt_timeout = 1.0
    manager.takeover.backoff = (0.1, 0.5)


@asynccontextmanager
async def node_at(base: Path, *, settings: Settings = FAST,
                  pool_unavailable: Callable[[str], str | None] | None = None,
                  adjust: Callable[[Node], None] | None = None, extra: str = "",
                  node_extra: str = "") -> AsyncIterator[Node]:
    """A running manager over `base`; its units are left running at exit (the next
    `node_at` adopts them; `stop_units` ends them)."""
    node = build_node(base, settings=settings, pool_unavailable=pool_unavailable,
                      extra=extra, node_extra=node_extra)
    if adjust is not None:
        adjust(node)
    async with trio.open_nursery() as nursery:
        await nursery.start(node.manager.run)
        yield node
        nursery.cancel_scope.cancel()


async def stop_units(base: Path) -> None:
    await stop_all_units(node_config(base))


@asynccontextmanager
async def node_root(prefix: str) -> AsyncIterator[Path]:
    """A fresh short storage root (`prefix` names the test file in it); at the end,
    shielded from the test's cancellation, the units left on it are stopped and the
    root is removed."""
    path = short_dir(prefix)
    try:
        yield path
    finally:
        with trio.CancelScope(shield=True):
            await stop_units(path)
        shutil.rmtree(path, ignore_errors=True)


async def start_instance(node: Node, instance_id: str, **extra: Any) -> dict[str, Any]:
    args = node.create_args(instance_id, workspace_id=f"ws-{instance_id}", **extra)
    assert await node.command("instance.create", args) == {"accepted": True}
    return await node.wait_state(instance_id, "RUNNING")


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie nobody reaped yet does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X", "x")


# ---------------------------------------------------------------------------- a child node

CHILD = """
import importlib, sys, trio
sys.path[:0] = [{here!r}, {plugins!r}]
from pathlib import Path
from adoption_harness import build_node
async def main():
    node = build_node(Path({base!r}), extra={extra!r}, node_extra={node_extra!r})
    beside = None
    if {beside!r}:
        module, name, *args = {beside!r}
        beside = getattr(importlib.import_module(module), name)(node, *args)
    async with trio.open_nursery() as nursery:
        await nursery.start(node.manager.run)
        if beside is not None:
            await nursery.start(beside.run)
        for kind, args in {steps!r}:
            if kind == "wait":
                await node.wait_state(args, "RUNNING")
            else:
                await node.command(kind, args)
        print("steps done", flush=True)
        await trio.sleep(600)
trio.run(main)
"""


async def run_child(base: Path, steps: list[tuple[str, Any]], failpoint: str, *,
                    extra: str = "", node_extra: str = "",
                    beside: tuple[str, ...] = ()) -> str:
    """A node process over `base` that runs `steps` (session commands, or ``("wait",
    instance_id)`` for RUNNING) and is SIGKILLed at `failpoint`; its stderr.  Fails
    when the failpoint was never reached.  `beside` is ``(module, function, *args)``
    of a test harness: ``function(node, *args)`` is called on the node before it runs
    and returns what runs beside its manager (``run(task_status=…)``, started after
    the manager's), as the node's serve runs its egress processes."""
    script = CHILD.format(here=str(HERE), plugins=str(TESTPLUGINS), base=str(base),
                          steps=steps, extra=extra, node_extra=node_extra,
                          beside=list(beside))
    env = {**os.environ, "KIBOTOS_FAILPOINTS": f"{failpoint}=kill"}
    with trio.fail_after(180):
        done = await trio.run_process([sys.executable, "-c", script], env=env, check=False,
                                      capture_stdout=True, capture_stderr=True)
    err = done.stderr.decode(errors="replace")
    assert done.returncode == -signal.SIGKILL, \
        f"{failpoint}: exit {done.returncode}; stderr ends: {err[-3000:]}"
    return err
