"""The holder check: fencing by epoch on the node itself, without ctrl.

Spec (storage-pools-on-nfs, "Epochs and takeover"): a node that was isolated may in
fact still reach a shared pool, and its VMs may still be writing.  Every 5 s this
check rereads the holder record of every object its Instances hold open.  When one
names a newer epoch (or another node at the same epoch), ctrl has handed the object to
another node, which is now waiting (at most 15 s) for this node's release receipt.  So
the node, on its own and whether or not it can reach ctrl:

1. stops the Instance's VMM at once (SIGTERM, SIGKILL after `FENCE_STOP_GRACE`): the
   VMM must stop writing, a guest sync would cost time the successor does not have;
2. confirms no process of the unit remains (else it retries at the next check and
   writes no receipt: a receipt is a promise that writing stopped);
3. flushes each block file (fsync: on NFS the client's dirty pages must reach the
   server before the successor opens) and writes the release receipt of each object
   that was taken over (`PoolObjects.fence`); objects of the same Instance that were
   not taken over get an ordinary release; then each one's attachment record goes;
4. reports the Instance FAILED with a reason saying the use right was taken over.

A check that cannot read a record (an NFS hiccup) logs it and tries again next time.

The check is given what it works with, as the manager's other helpers are (`Takeover`,
`PendingCleanups`): the `Launcher` (pools, unit stop, attachment records) and two
callbacks of the manager, ``instances`` (the Instances the node has now) and ``fail``
(make one FAILED, persisted and published).  It does not know the manager.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterable, Sequence

import trio

from kibotos.core.errors import KibotosError
from kibotos.core.logs import EventLogger
from kibotos.node.instances.lifecycle import HeldObject, Instance, Launcher
from kibotos.node.storage.objects import Holder

log = EventLogger()

#: How often the holder records are reread (spec: 5 s).
HOLDER_CHECK_INTERVAL = 5.0
#: Between SIGTERM and SIGKILL when fencing: a VMM that exits on SIGTERM flushes its
#: own caches; one that does not is killed before the successor's 15 s run out.
FENCE_STOP_GRACE = 1.0
#: How every reason of a fenced Instance begins (ctrl and operators match on it).
TAKEN_OVER = "use right was taken over"

Found = list[tuple[HeldObject, Holder]]


class HolderWatch:
    """Runs the check of the module docstring over one node's Instances."""

    def __init__(self, launcher: Launcher, *, instances: Callable[[], Iterable[Instance]],
                 fail: Callable[[Instance, str], Awaitable[None]],
                 interval: float = HOLDER_CHECK_INTERVAL) -> None:
        self.launcher = launcher
        self.instances = instances
        self.fail = fail
        self.interval = interval

    async def run(self) -> None:
        while True:
            await trio.sleep(self.interval)
            try:
                await self.check()
            except Exception as exc:  # a bug or a dead disk must not end the node
                log.error("holder check failed", error=repr(exc))

    async def check(self) -> list[str]:
        """One pass over every Instance with objects open; the IDs it fenced."""
        fenced = []
        for inst in self.instances():
            if inst.released or not inst.held:
                continue
            found = await self._taken_over(inst, inst.held)
            try:
                if found and await self.fence(inst):
                    fenced.append(inst.instance_id)
            except (KibotosError, OSError) as exc:  # the receipt: tried again next time
                log.error("holder check: fencing failed", instance=inst.instance_id,
                          error=str(exc))
        return fenced

    async def _taken_over(self, inst: Instance, held: Sequence[HeldObject]) -> Found:
        found: Found = []
        for obj in held:
            try:
                pool = self.launcher.pool(obj.pool_id, obj.kind)
                successor = await trio.to_thread.run_sync(pool.taken_over, obj.object_id,
                                                          obj.epoch)
            except (KibotosError, OSError) as exc:
                log.warning("holder check: cannot read a holder record",
                            instance=inst.instance_id, pool=obj.pool_id,
                            object=obj.object_id, error=str(exc))
                continue
            if successor is not None:
                found.append((obj, successor))
        return found

    async def fence(self, inst: Instance) -> bool:
        """Stop, flush, close, receipt, FAILED; False when the stop could not be
        confirmed (the next check tries again) or there was nothing left to fence."""
        if inst.boot_scope is not None:
            inst.boot_scope.cancel()  # a boot still under way must not start the VMM
        async with inst.lock:
            if inst.released:
                return False
            found = await self._taken_over(inst, inst.held)
            if not found:
                return False
            first, successor = found[0]
            log.error("holder check: use right taken over; stopping the Instance",
                      instance=inst.instance_id, kind=first.kind, pool=first.pool_id,
                      object=first.object_id, epoch=first.epoch,
                      successor=successor.node_id, successor_epoch=successor.epoch)
            try:
                await self.launcher.stop_unit(inst, timeout=FENCE_STOP_GRACE)
            except (KibotosError, OSError) as exc:
                log.error("holder check: the VMM did not stop; no receipt yet",
                          instance=inst.instance_id, error=str(exc))
                await self.fail(inst, f"{TAKEN_OVER}, but its VMM did not stop yet: {exc}")
                return False
            taken = dict(found)
            for obj in inst.held:
                pool = self.launcher.pool(obj.pool_id, obj.kind)
                succ = taken.get(obj)
                if succ is not None:
                    await trio.to_thread.run_sync(functools.partial(
                        pool.fence, obj.object_id, obj.epoch, successor=succ))
                else:
                    await trio.to_thread.run_sync(functools.partial(
                        pool.release, obj.object_id, obj.epoch, confirmed_on_disk=False))
                await self.launcher.drop_attachment(inst, obj)
            inst.released = True
            what = (f"{first.kind.rstrip('s').replace('-', ' ')} {first.object_id} in "
                    f"pool {first.pool_id}")
            reason = (f"{TAKEN_OVER}: {what} is held by node {successor.node_id} at epoch "
                      f"{successor.epoch} (this Instance held epoch {first.epoch}); its VMM "
                      "was stopped and the release receipt written")
            log.info("holder check: release receipt written", instance=inst.instance_id,
                     objects=len(taken))
            await self.fail(inst, reason)
            return True
