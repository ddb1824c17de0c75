"""``stop_prepare``, ``sync`` and ``thaw``: ending managed processes by a deadline, then
syncing and freezing the retained file systems so the disks hold everything written.

The kernel calls that can block on a stuck disk (syncfs, FIFREEZE, sync) run in worker
threads with deadlines; the agent keeps answering whatever they do.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import signal

from .configure import retained
from .errors import AgentError, field, guest_path, seconds_field
from .runtime.loop import get_loop
from .runtime.sysio import FIFREEZE, FITHAW, mount_at, syncfs_path
from .runtime.tasks import run_in_thread, sleep, wait_for
from .services.processes import members

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any

    from .core import Agent
    from .runtime.tasks import Future

#: After SIGKILL, how long the stragglers get to disappear.
KILL_GRACE = 5.0


async def stop_prepare_request(agent: Agent, msg: dict[str, Any]) -> dict[str, Any]:
    """End managed processes by the deadline, then sync and freeze retained file systems.

    Sync and freeze run even after a missed deadline (the stragglers were killed), so
    data already written is protected whatever the outcome; the first failure names
    the reason.  After a failure the frozen file systems stay frozen.
    """
    timeout = seconds_field(msg, "timeout")
    sync_timeout = seconds_field(msg, "sync_timeout", 30.0)
    raw = field(msg, "filesystems", list, None)
    paths = retained(agent) if raw is None else [
        guest_path(p, "stop_prepare: filesystem") for p in raw]
    agent.stopping = True
    ended, killed, survivors = await _end_managed(agent, timeout)
    failures: list[dict[str, str]] = []
    if killed:
        names = ", ".join(f"{pid} ({killed[pid]})" for pid in sorted(killed))
        text = (f"{len(killed)} managed process(es) did not end within {timeout:g}s of "
                f"SIGTERM and were killed: {names}")
        if survivors:
            text += f"; still present after SIGKILL: {', '.join(map(str, sorted(survivors)))}"
        failures.append({"reason": "deadline_exceeded", "message": text})
    synced, sync_failed = await _sync_filesystems(agent, paths, sync_timeout)
    if sync_failed:
        failures.append({"reason": "retained filesystem sync failed",
                         "message": "; ".join(sync_failed)})
    frozen, freeze_failed = await _freeze_filesystems(agent, paths, sync_timeout)
    if freeze_failed:
        failures.append({"reason": "retained filesystem freeze failed",
                         "message": "; ".join(freeze_failed)})
    result = {"ended": sorted(ended), "killed": sorted(killed), "synced": synced,
              "frozen": frozen}
    if failures:
        first = failures[0]
        code = "deadline_exceeded" if first["reason"] == "deadline_exceeded" else "internal"
        raise AgentError(code, f"{first['reason']}: {first['message']}",
                         {"reason": first["reason"], "failures": failures, **result})
    return result


def _signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue


async def _end_managed(agent: Agent, timeout: float) -> (
    tuple[set[int], dict[int, str], dict[int, str]]
):
    loop = get_loop()
    deadline = loop.time() + timeout
    signalled: set[int] = set()
    ended: set[int] = set()
    current = members(agent)
    while current:
        latecomers = current.keys() - signalled  # processes forked meanwhile get it too
        _signal_all(latecomers, signal.SIGTERM)
        _signal_all(latecomers, signal.SIGCONT)
        signalled |= latecomers
        ended |= current.keys()
        if loop.time() >= deadline:
            break
        await sleep(min(0.05, max(0.0, deadline - loop.time())))
        current = members(agent)
    killed = dict(current)
    grace = loop.time() + KILL_GRACE
    while current and loop.time() < grace:
        _signal_all(current, signal.SIGKILL)
        killed.update(current)
        await sleep(0.05)
        current = members(agent)
    return ended - killed.keys(), killed, current


def _mount_point(agent: Agent, path: str) -> str:
    real = os.path.realpath(agent.path(path))
    if mount_at(real) is None:
        raise OSError(errno.EINVAL, "not a mount point")
    return real


async def _sync_filesystems(agent: Agent, paths: list[str], timeout: float) -> (
    tuple[list[str], list[str]]
):
    synced, failed = [], []
    for path in paths:
        if path in agent.frozen:
            synced.append(path)
            continue
        try:
            await wait_for(run_in_thread(syncfs_path, _mount_point(agent, path)), timeout)
            synced.append(path)
        except TimeoutError:
            failed.append(f"{path}: no answer within {timeout:g}s")
        except OSError as e:
            failed.append(f"{path}: {e.strerror or e}")
    return synced, failed


def _freeze_path(path: str) -> int:
    """FIFREEZE the file system mounted at `path`; the returned descriptor thaws it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, FIFREEZE, 0)
    except OSError as e:
        if e.errno != errno.EBUSY:  # EBUSY: already frozen, which is what we want
            os.close(fd)
            raise
    return fd


async def _freeze_filesystems(agent: Agent, paths: list[str], timeout: float) -> (
    tuple[list[str], list[str]]
):
    failed = []
    for path in paths:
        if path in agent.frozen:
            continue
        try:
            work = run_in_thread(_freeze_path, _mount_point(agent, path))
            # A freeze that finishes after we stopped waiting is still recorded, so that
            # hello reports it and thaw undoes it.
            work.add_done_callback(functools.partial(_record_freeze, agent, path))
            await wait_for(work, timeout)
        except TimeoutError:
            failed.append(f"{path}: no answer within {timeout:g}s")
        except OSError as e:
            why = "freezing is not supported" if e.errno == errno.EOPNOTSUPP else e.strerror
            failed.append(f"{path}: {why or e}")
    return sorted(p for p in paths if p in agent.frozen), failed


def _record_freeze(agent: Agent, path: str, work: Future) -> None:
    if work.exception() is not None:
        return
    if path in agent.frozen:
        os.close(work.result())
    else:
        agent.frozen[path] = work.result()


async def sync_request(msg: dict[str, Any]) -> dict[str, Any]:
    timeout = seconds_field(msg, "timeout", 10.0)
    try:
        await wait_for(run_in_thread(os.sync), timeout)
    except TimeoutError:
        raise AgentError("deadline_exceeded", f"sync did not finish in {timeout:g}s") from None
    return {"synced": True}


def thaw_request(agent: Agent) -> dict[str, Any]:
    """FITHAW everything the agent froze; exec is accepted again."""
    thawed, failed = [], []
    for path, fd in sorted(agent.frozen.items()):
        try:
            fcntl.ioctl(fd, FITHAW, 0)
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: not frozen (any more)
                failed.append(f"{path}: {e.strerror}")
                continue
        os.close(fd)
        del agent.frozen[path]
        thawed.append(path)
    if failed:
        raise AgentError("internal", f"thaw failed: {'; '.join(failed)}", {"thawed": thawed})
    agent.stopping = False
    return {"thawed": thawed}
