"""The background half of adoption: storage, the guest, and unfinished creations.

`kibotos.node.instances.adoption` decides at start which Instances run on; this module then
takes each over without holding up the node (spec: node-and-vmm-processes, "Launch
records and adoption" and Troubleshooting):

* **Storage** first: the writable layer and the Volumes are opened again at their
  recorded epochs (the holder records must still name this node).  The node waits up
  to ``Settings.takeover_pool_wait`` (5 minutes) for each pool to open the first time,
  one wait per pool for all its Instances.  A pool that does not open in time logs
  ``storage pool not opened for takeover``; that, or a pool that reports unavailable
  afterwards, makes the Instance FAILED (``recover instance process: stage
  PREPARING_RETAINED_LAYER|ATTACHING_VOLUME: …``, the VMM keeps running, adoption is
  not retried).
* **The network** next: the slot table is read back and rewritten from the recorded
  policy with this version in one transaction (connections survive; the log
  ``slot table rewritten from the recorded network policy`` names the Instance, the
  namespace and the differences), or, in the spec's four refusal cases, the network is
  isolated and the Instance FAILED (``… stage ATTACHING_NETWORK: network isolated:
  …``), its VMM running on.
* **The guest** then gets its launch configuration again (`Launcher.launch_config`,
  what a booting guest gets; the node has no DNS of its own to hand over yet), with
  backoff and without end while it does not answer: the Instance stays RUNNING, its
  ``guest.responding`` is false (the ``instance_state`` frame says so), and each failed
  attempt logs ``instance guest sync pending``; the success after one carries
  ``recovered=true``.  A guest with another boot ID restarted while the node was away:
  it is configured the same way and its new hello recorded.  A guest that answers but
  refuses (protocol version out of range, an error reply) makes the Instance FAILED,
  the VMM still running.
* An Instance still **CREATING** is the exception: its guest never passed readiness, so
  readiness is awaited as in a first boot, and creation fails on the timeout (its unit
  is then stopped, as any failed boot's).

Every step runs under the Instance's lock with its ``boot_scope`` set, so a stop with
force or a destroy cancels it at once; an Instance whose takeover failed is reclaimed
only after `kibotos.node.instances.adoption.check_ownership`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import trio

from kibotos.backends import Supervisor
from kibotos.core.errors import FailedPrecondition, InvalidArgument, KibotosError
from kibotos.core.logs import EventLogger
from kibotos.guest import GuestInfo, open_guest_channel
from kibotos.node.instances.contract import FAILED, RUNNING
from kibotos.node.instances.lifecycle import HeldObject, Instance, Launcher
from kibotos.node.network.enforce import REWRITTEN_LOG
from kibotos.node.records import instance_records as records
from kibotos.node.runtime import installations
from kibotos.node.session.backoff import Backoff
from kibotos.node.storage.objects import RETAINED_LAYERS, VOLUMES, PoolObjects
from kibotos.vmm_ready import first_kibotos_error

log = EventLogger()

STAGE_LAYER = "PREPARING_RETAINED_LAYER"
STAGE_VOLUME = "ATTACHING_VOLUME"
STAGE_GUEST = "CONFIGURING_GUEST"
STAGE_INSTALLATION = "RETAINING_RUNTIME_INSTALLATION"
STAGE_NETWORK = "ATTACHING_NETWORK"
RECOVER = "recover instance process"
#: One attempt to reach an adopted guest: connect, hello, configure.
ATTEMPT_TIMEOUT = 10.0
#: How long adoption waits for a pool of an adopted Instance to open the first time.
TAKEOVER_POOL_WAIT = 300.0
#: How often a pool that has not opened yet is looked at again.
_POOL_POLL = 1.0
#: Answers that mean the guest refuses (it answered); anything else is "not responding".
REFUSALS = (FailedPrecondition, InvalidArgument)

SetState = Callable[[Instance, str, "str | None"], Awaitable[None]]


class StageFailed(Exception):
    """A takeover step failed; `stage` is the spec's stage name."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(f"{stage}: {message}")
        self.stage = stage
        self.message = message


class PoolGate:
    """Waits once per pool for it to open the first time, for every Instance at once."""

    def __init__(self, wait: float) -> None:
        self.wait = wait
        self._done: dict[str, trio.Event] = {}
        self._reason: dict[str, str | None] = {}

    async def opened(self, pool: PoolObjects, stage: str) -> str | None:
        """None once the pool is available; else why it did not open in time."""
        key = pool.pool_id
        if key in self._done:
            await self._done[key].wait()
            return self._reason[key]
        self._done[key] = done = trio.Event()
        start = trio.current_time()
        reason: str | None = None
        try:
            while True:
                try:
                    pool.check_available()
                    reason = None
                    break
                except KibotosError as exc:
                    reason = exc.message
                left = start + self.wait - trio.current_time()
                if left <= 0:
                    break
                await trio.sleep(min(_POOL_POLL, left))
        finally:
            self._reason[key] = reason
            done.set()
        if reason is not None:
            log.error("storage pool not opened for takeover", pool=key, stage=stage,
                      waited_s=round(trio.current_time() - start, 1), reason=reason)
        return reason


def installation_retained(root: Path, inst: Instance, launch: Mapping[str, Any] | None,
                          launcher: Launcher,
                          seen: dict[str, installations.Retention] | None = None) -> None:
    """An Instance an earlier build started may pin an earlier runtime installation: it
    is kept only when complete and in range (`kibotos.node.runtime.installations.assess`; a
    refusal logs ``earlier runtime installation cannot be retained`` with the exact reason);
    otherwise `StageFailed` with the spec's ``compatible runtime installation
    unavailable``.  A node that pinned no installation itself has nothing to compare.
    `seen` keeps each verdict by the recorded installation: many Instances usually pin
    the same one, and checking it means hashing every file."""
    current = launcher.installation
    if current is None:
        return
    recorded = (launch or {}).get("installation")
    key = repr(sorted(recorded.items())) if isinstance(recorded, dict) else repr(recorded)
    verdict = seen.get(key) if seen is not None else None
    if verdict is None:
        verdict = installations.assess(root, recorded, current.get("identity"),
                                       launcher.build)
        if seen is not None:
            seen[key] = verdict
    if not verdict.ok:
        log.error(installations.NOT_RETAINED_EVENT, instance=inst.instance_id,
                  installation=verdict.identity, reason=verdict.problem)
        raise StageFailed(STAGE_INSTALLATION, f"{verdict.error} ({verdict.problem})")


class Takeover:
    """The background takeover of the Instances `adoption.examine` kept."""

    def __init__(self, *, root: Path, launcher: Launcher, set_state: SetState,
                 publish: Callable[[Instance], None], pool_wait: float,
                 facts_at_readiness: Callable[[Instance, Supervisor],
                                              Awaitable[dict[str, Any]]]) -> None:
        self.root = root
        self.facts_at_readiness = facts_at_readiness
        self.launcher = launcher
        self.set_state = set_state
        self.publish = publish
        self.gate = PoolGate(pool_wait)
        #: Instances reloaded at start and not taken over (reclaim checks ownership).
        self.not_taken_over: set[str] = set()
        self._installations: dict[str, installations.Retention] = {}
        self.attempt_timeout = ATTEMPT_TIMEOUT
        self.backoff = (0.5, 30.0)
        self._active = 0
        self._idle = trio.Event()
        self._idle.set()

    # ------------------------------------------------------------------ bookkeeping

    def _begin(self) -> None:
        self._active += 1
        if self._idle.is_set():
            self._idle = trio.Event()

    def _finish(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Until every takeover task ended (tests and bench/adopt.py)."""
        await self._idle.wait()

    async def _fail(self, inst: Instance, stage: str, message: str) -> None:
        reason = f"{RECOVER}: stage {stage}: {message}"
        log.error("instance takeover failed", instance=inst.instance_id, stage=stage,
                  unit=inst.unit_name, error=message)
        self.not_taken_over.add(inst.instance_id)
        await self.set_state(inst, FAILED, reason)

    # ------------------------------------------------------------------ RUNNING

    async def adopt(self, inst: Instance, launch: Mapping[str, Any] | None) -> None:
        """Storage, then the guest, of an Instance adopted RUNNING."""
        self._begin()
        try:
            async with inst.lock:
                if inst.state != RUNNING:
                    return
                with trio.CancelScope() as scope:
                    inst.boot_scope = scope
                    try:
                        await trio.to_thread.run_sync(installation_retained, self.root, inst,
                                                      launch, self.launcher,
                                                      self._installations)
                        await self.reattach_storage(inst)
                        await self.reattach_network(inst)
                    except StageFailed as exc:
                        await self._fail(inst, exc.stage, exc.message)
                        return
                    finally:
                        inst.boot_scope = None
                if scope.cancelled_caught:
                    return
            await self.sync_guest(inst)
        finally:
            self._finish()

    async def reattach_storage(self, inst: Instance) -> None:
        """Open the layer and the Volumes again at their epochs, after their pools
        opened; `inst.held` lists them again (a launch cut short may not have saved it),
        and each has its attachment record (written before the open, kept on failure:
        the running VMM still has the object open)."""
        spec = inst.spec
        wanted = [(STAGE_LAYER, HeldObject(RETAINED_LAYERS, spec.layer.pool_id,
                                           spec.layer.ref, spec.layer.epoch))]
        wanted += [(STAGE_VOLUME, HeldObject(VOLUMES, v.pool_id, v.volume_id, v.epoch))
                   for v in spec.volumes]
        for stage, obj in wanted:
            try:
                pool = self.launcher.pool(obj.pool_id, obj.kind)
                reason = await self.gate.opened(pool, stage)
                if reason is not None:
                    raise StageFailed(stage, f"storage pool not opened for takeover within "
                                             f"{self.gate.wait:.0f}s: {reason}")
                # the VMM has it open already: its record stays whatever happens next
                await self.launcher.record_attachments(inst, [obj])
                await pool.open(obj.object_id, obj.epoch)
            except (KibotosError, OSError) as exc:
                raise StageFailed(stage, exc.message if isinstance(exc, KibotosError)
                                  else str(exc)) from None
            if obj not in inst.held:
                inst.held.append(obj)
            inst.released = False

    async def reattach_network(self, inst: Instance) -> None:
        """The Instance's slot table regenerated from the recorded policy with this
        version and replaced in one transaction (established connections survive), or,
        in the spec's four refusal cases, its network isolated: `StageFailed`, the
        Instance FAILED, its VMM left running."""
        try:
            step = self.launcher.network_step(inst)
            if step is None:
                return
            pid = inst.main_process[0] if inst.main_process else None
            adopted = await step.adopt(inst.instance_id, pid)
        except (KibotosError, OSError) as exc:
            raise StageFailed(STAGE_NETWORK, exc.message if isinstance(exc, KibotosError)
                              else str(exc)) from None
        if adopted is None:
            raise StageFailed(STAGE_NETWORK, f"the network record of {inst.instance_id} is "
                                             "missing: its network cannot be checked")
        fields = adopted.log_fields()
        if adopted.report.refused:
            log.error("slot table not rewritten: the network is isolated", **fields)
            raise StageFailed(STAGE_NETWORK, "network isolated: "
                              + "; ".join(adopted.report.refusals))
        log.info(REWRITTEN_LOG, **fields)

    async def _configure(self, inst: Instance) -> GuestInfo:
        """One attempt: the guest's hello, its protocol version checked against this
        build's range, then the launch configuration a booting guest gets."""
        assert inst.launch is not None
        config = self.launcher.launch_config(inst)
        deadline = trio.current_time() + self.attempt_timeout
        stream = await self.launcher.backend.guest_channel(inst.launch,
                                                           timeout=self.attempt_timeout)
        try:
            async with open_guest_channel(
                    stream, accepted=self.launcher.build.guest_protocols) as channel:
                info = await channel.wait_hello(deadline)
                await channel.configure(config)
                return info
        except BaseExceptionGroup as group:
            found = first_kibotos_error(group)
            if found is None:
                raise
            raise found from None

    async def sync_guest(self, inst: Instance) -> None:
        """Hand the guest its configuration again until it answers (or refuses)."""
        backoff = Backoff(*self.backoff)
        attempts = 0
        pending = False
        while True:
            attempts += 1
            error = ""
            async with inst.lock:
                if inst.state != RUNNING:
                    return  # stopped, destroyed or failed meanwhile: nothing to hand over
                with trio.CancelScope() as scope:
                    inst.boot_scope = scope
                    try:
                        with trio.move_on_after(self.attempt_timeout) as attempt:
                            info = await self._configure(inst)
                        if attempt.cancelled_caught:
                            error = f"no answer within {self.attempt_timeout:.0f}s"
                    except REFUSALS as exc:
                        await self._fail(inst, STAGE_GUEST, f"guest refused: {exc.message}")
                        return
                    except (KibotosError, OSError) as exc:
                        error = exc.message if isinstance(exc, KibotosError) else str(exc)
                    finally:
                        inst.boot_scope = None
                if scope.cancelled_caught:
                    return
                if not error:
                    await self._synced(inst, info, attempts, pending)
                    return
            delay = backoff.next_delay()
            pending = True
            log.warning("instance guest sync pending", instance=inst.instance_id,
                        attempt=attempts, error=error, retry_in_s=round(delay, 2))
            await trio.sleep(delay)

    async def _synced(self, inst: Instance, info: GuestInfo, attempts: int,
                      pending: bool) -> None:
        recorded = (inst.guest or {}).get("boot_id")
        if info.boot_id != recorded:
            log.warning("instance guest restarted while the node was away: reconfigured",
                        instance=inst.instance_id, recorded_boot_id=recorded,
                        boot_id=info.boot_id)

            def record() -> None:
                launch = records.read_launch_record(inst.dir) or {}
                records.add_guest(inst.dir, launch, info.to_json())

            await trio.to_thread.run_sync(record)
        inst.guest = {"boot_id": info.boot_id, "capabilities": sorted(info.capabilities),
                      "responding": True}
        if pending:
            log.info("instance guest sync pending", instance=inst.instance_id,
                     recovered=True, attempts=attempts)
        if info.boot_id != recorded:
            await self.set_state(inst, RUNNING, None)  # persisted: the new boot ID
        else:
            self.publish(inst)

    # ------------------------------------------------------------------ CREATING

    async def finish_boot(self, inst: Instance) -> None:
        """A creation the previous node process left with its VMM running: storage,
        readiness within ``ready_timeout``, configuration, RUNNING; a failure stops the
        unit and fails the creation, as in a first boot."""
        self._begin()
        try:
            async with inst.lock:
                with trio.CancelScope() as scope:
                    inst.boot_scope = scope
                    try:
                        await self._finish_steps(inst)
                    except (KibotosError, OSError, StageFailed) as exc:
                        reason = exc.message if isinstance(exc, KibotosError | StageFailed) \
                            else str(exc)
                        log.error("instance boot failed", instance=inst.instance_id,
                                  error=reason, adopted=True)
                        with trio.CancelScope(shield=True):
                            try:
                                await self.launcher.stop_unit(inst)
                            except (KibotosError, OSError) as stop_exc:
                                log.error("instance boot failed and its unit did not stop",
                                          instance=inst.instance_id, error=str(stop_exc))
                            await self.set_state(inst, FAILED, reason)
                    finally:
                        inst.boot_scope = None
        finally:
            self._finish()

    async def _finish_steps(self, inst: Instance) -> None:
        assert inst.launch is not None
        await self.reattach_storage(inst)
        await self.reattach_network(inst)
        guest = await self.launcher.wait_ready(inst, inst.launch)
        await self.launcher.configure_guest(inst)
        record = await self.facts_at_readiness(inst, self.launcher.supervisor)
        await trio.to_thread.run_sync(records.add_guest, inst.dir, record, guest)
        inst.guest = {"boot_id": guest.get("boot_id"),
                      "capabilities": sorted(guest.get("capabilities") or [])}
        log.info("instance running", instance=inst.instance_id, unit=inst.unit_name,
                 boot_id=inst.guest["boot_id"], adopted=True)
        await self.set_state(inst, RUNNING, None)
