"""Stuck releases: a stop or destroy whose VMM unit ended but left processes behind
(spec: node-and-vmm-processes, Troubleshooting, "instance cleanup pending").

A VMM in an uninterruptible wait (typically on a storage mount that stopped answering)
survives SIGKILL: the supervisor's stop gives up (``DeadlineExceeded`` naming the
processes), or the unit's main process still exists afterwards (``Unavailable``).  The
objects must not be released while such a process may still write to them.  Instead
of failing the Instance, the node keeps it in STOPPING and retries on its own in the
background (`PendingCleanups`): each failed attempt is an ``instance cleanup pending``
log record, and the ``instance_state`` frame carries ``cleanup{pending_since, held}``
(what is still held: the processes, the objects not yet released), which ctrl shows in
``cleanup-status``.  Once the processes are gone the node releases the objects and the
Instance reaches its final state (STOPPED, or DESTROYED when a destroy asked), without
waiting for ctrl.  A command about a pending Instance waits a little for the outcome,
then answers ``unavailable`` (ctrl retries).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from kibotos.core.errors import DeadlineExceeded, KibotosError, Unavailable
from kibotos.core.logs import EventLogger
from kibotos.node.instances.contract import DESTROYED
from kibotos.node.instances.lifecycle import Instance, Launcher
from kibotos.node.records import instance_records as records
from kibotos.node.storage.objects import RETAINED_LAYERS, VOLUMES
from kibotos.protocol.values import clip

log = EventLogger()

#: Pause between two attempts (each attempt is a full unit stop, SIGKILL included).
RETRY_S = 5.0
#: How long a repeated stop or destroy waits for a pending release before answering
#: ``unavailable`` (well inside ctrl's command timeouts).
COMMAND_WAIT_S = 20.0
#: How a held object is named in ``held``.
KIND_NAMES = {RETAINED_LAYERS: "writable layer", VOLUMES: "Volume"}
#: What stopping the unit raises when processes are left.
STUCK_ERRORS = (Unavailable, DeadlineExceeded)


@dataclass
class Pending:
    inst: Instance
    final: str
    confirmed: bool
    since: str
    held: list[dict[str, str]]
    attempts: int = 1
    finished: bool = False
    done: trio.Event = field(default_factory=trio.Event)

    def frame_extra(self) -> dict[str, Any]:
        return {"cleanup": {"pending_since": self.since, "held": list(self.held)}}

    def result(self, final: str) -> dict[str, Any]:
        if final == DESTROYED:
            return {"destroyed": True}
        return {"confirmed_on_disk": self.confirmed}


def held_parts(inst: Instance, error: KibotosError) -> list[dict[str, str]]:
    """What a stuck release still holds, by cleanup item."""
    parts = [{"item": "RUNTIME", "part": clip(error.message) or ""}]
    if not inst.released:
        parts.extend({"item": "VOLUME_ATTACHMENT",
                      "part": f"{KIND_NAMES.get(h.kind, h.kind)} {h.object_id} of pool "
                              f"{h.pool_id} (epoch {h.epoch})"}
                     for h in inst.held)
    return parts


class PendingCleanups:
    """The node's stuck releases, retried in the background until they finish.

    `finish(inst, final, confirmed)` is the manager's end of a release (use rights kept,
    registry entry, directory removed, final frame); `publish(inst, extra)` sends an
    ``instance_state`` frame with `extra` fields."""

    def __init__(self, launcher: Launcher, *,
                 finish: Callable[[Instance, str, bool], Awaitable[None]],
                 publish: Callable[[Instance, dict[str, Any]], None],
                 retry_s: float = RETRY_S) -> None:
        self.launcher = launcher
        self._finish = finish
        self._publish = publish
        self.retry_s = retry_s
        self.command_wait_s = COMMAND_WAIT_S
        self._pending: dict[str, Pending] = {}

    def get(self, instance_id: str) -> Pending | None:
        return self._pending.get(instance_id)

    def begin(self, nursery: trio.Nursery, inst: Instance, *, final: str, confirmed: bool,
              error: KibotosError) -> Unavailable:
        """The release of `inst` got stuck: remember it, tell ctrl what is held, retry in
        the background; returns the error the command answers with."""
        pending = self._pending.get(inst.instance_id)
        if pending is None:
            pending = Pending(inst, final, confirmed, records.now_iso(),
                              held_parts(inst, error))
            self._pending[inst.instance_id] = pending
            nursery.start_soon(self._retry, pending)
        else:
            pending.final = DESTROYED if DESTROYED in (final, pending.final) else final
        self._log(pending)
        self._publish(inst, pending.frame_extra())
        return self._error(pending)

    async def wait(self, pending: Pending, final: str) -> dict[str, Any]:
        """A stop (`final` STOPPED) or destroy (DESTROYED) of a pending Instance: the
        result once the release finished, ``unavailable`` if it does not soon."""
        if final == DESTROYED:
            pending.final = DESTROYED
        with trio.move_on_after(self.command_wait_s):
            await pending.done.wait()
            if pending.finished:
                return pending.result(final)
        raise self._error(pending)

    @staticmethod
    def _error(pending: Pending) -> Unavailable:
        held = "; ".join(p["part"] for p in pending.held)
        return Unavailable(f"instance cleanup pending since {pending.since}: {held}",
                           details={"pending_since": pending.since, "held": pending.held})

    @staticmethod
    def _log(pending: Pending) -> None:
        log.warning("instance cleanup pending", instance=pending.inst.instance_id,
                    since=pending.since, attempts=pending.attempts,
                    held="; ".join(p["part"] for p in pending.held))

    async def _retry(self, pending: Pending) -> None:
        inst = pending.inst
        try:
            while True:
                await trio.sleep(self.retry_s)
                async with inst.lock:
                    try:
                        await self.launcher.stop_unit(inst)
                        await self.launcher.release_objects(
                            inst, confirmed_on_disk=pending.confirmed)
                        await self.launcher.release_network(inst)
                    except STUCK_ERRORS as exc:
                        pending.attempts += 1
                        pending.held = held_parts(inst, exc)
                        self._log(pending)
                        # Every attempt: a ctrl that reconnected meanwhile learns it too.
                        self._publish(inst, pending.frame_extra())
                        continue
                    except (KibotosError, OSError) as exc:
                        pending.attempts += 1
                        log.error("instance cleanup retry failed", instance=inst.instance_id,
                                  error=exc.message if isinstance(exc, KibotosError)
                                  else str(exc))
                        continue
                    log.info("instance cleanup finished", instance=inst.instance_id,
                             since=pending.since, attempts=pending.attempts,
                             state=pending.final)
                    await self._finish(inst, pending.final, pending.confirmed)
                    pending.finished = True
                    return
        finally:
            self._pending.pop(inst.instance_id, None)
            pending.done.set()

