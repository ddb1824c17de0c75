"""The node's side of its data-plane process: start or adopt it, hand it state, restart it.

The data plane (``kibotos dataplane serve``, `kibotos.dataplane`) runs as its own unit,
``kibotos-dataplane-<scope>-<generation>``, through the node's supervisor plugin, so it
outlives node restarts (spec: node-and-vmm-processes, "Data-plane processes").  The
scope is derived from the node's socket directory, so several nodes on one host never
touch each other's processes; the generation grows by one on every start and is
persisted in ``<storage.root>/state/dataplane-generation`` before the unit starts.

At node start, the newest running data-plane process of this scope (the one that
answers on the control socket as the generation its unit name says) is adopted,
handed over, rebound or restarted as the spec's table says
(`kibotos.node.dataplane.generations`): same build and listen address, adopted;
another build of the same release line, a new generation takes over its listening
socket and it drains; another listen address, the new one binds it and the old one
drains on the old; another release line, it is ended first.  At most one old
generation waits for its connections (`waiting`); the next replacement ends it.  A
handover or rebind whose new generation does not come up leaves the old one serving,
and is tried again while the node runs.

State: the node hands over the whole state (ctrl's public key, node ID, the running
Instances' data-plane agent sockets) on every change and waits for the ack, at most
`confirm_timeout` (5 s); without it, it logs the spec's warning and goes on, and keeps
resending every `watch_interval` until the process confirms (the spec allows 15 s).
ctrl's public key is kept in ``<storage.root>/state/session-signing-public-key``, so a
restarted node can hand over state before ctrl answers.  When the process exits, a new
generation starts within a few seconds (backing off while it keeps failing), and the
counters it had are kept in the node's sum (`kibotos.dataplane.process.metrics.MetricsSum`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from kibotos.backends import Supervisor, UnitInfo, UnitSpec
from kibotos.core import atomicfile, failpoints
from kibotos.core.credentials import parse_public_key
from kibotos.core.errors import InvalidArgument, KibotosError, Unavailable
from kibotos.core.logs import EventLogger
from kibotos.dataplane.process import listen_handover
from kibotos.dataplane.process.build import source_build_id
from kibotos.dataplane.process.control import check_socket_path, control_call, control_path
from kibotos.dataplane.process.metrics import MetricsSum
from kibotos.dataplane.process.state import Target, state_message
from kibotos.node.dataplane.generations import ADOPT, HAND_OVER, REBIND, Decision, decide
from kibotos.node.network.names import node_scope
from kibotos.node.runtime.process_units import ProcessUnits
from kibotos.node.session.backoff import Backoff

log = EventLogger()

UNIT_PREFIX = "kibotos-dataplane-"
GENERATION_FILE = "dataplane-generation"
PUBLIC_KEY_FILE = "session-signing-public-key"
#: Why a waiting generation is ended (`DataplaneSupervisor.waiting`).
NEWER_DRAINS = "a newer generation is about to drain"
#: The spec's words, logged when the process did not confirm in time.
NOT_CONFIRMED = "data-plane generation did not take the node's state before the reply"
UNIT_PROPERTIES: dict[str, Any] = {
    "Type": "exec", "Slice": "kibotos-dataplane.slice", "Restart": "no",
    "KillMode": "control-group", "OOMScoreAdjust": -900,
}


@dataclass(frozen=True)
class DataplaneTiming:
    confirm_timeout: float = 5.0  # the spec's wait for the ack before replying anyway
    watch_interval: float = 1.0  # how often the unit is looked at and unsent state resent
    resend_interval: float = 10.0  # a full resend even when nothing changed
    metrics_interval: float = 10.0
    start_timeout: float = 60.0  # unit start to its control socket answering
    stop_timeout: float = 15.0  # SIGTERM, the process's 10 s drain, then SIGKILL
    restart_initial: float = 1.0
    restart_cap: float = 10.0


def scope_of(socket_dir: Path) -> str:
    """Eight hex digits naming this node's processes on the host (the same scope names
    its Instances' network objects: `kibotos.node.network.names.node_scope`)."""
    return node_scope(socket_dir)


#: The data plane's units and generation counter (`kibotos.node.runtime.process_units`).
UNITS = ProcessUnits(UNIT_PREFIX, GENERATION_FILE, "data-plane")
unit_name = UNITS.unit_name
generation_of = UNITS.generation_of
read_generation = UNITS.read_generation


class DataplaneSupervisor:
    """See the module docstring.  `run` in the node's nursery, before the session."""

    def __init__(self, *, node_id: str, listen: str, socket_dir: Path, state_dir: Path,
                 supervisor: Supervisor, python: str | None = None,
                 timing: DataplaneTiming | None = None, tls: bool = True) -> None:
        self.node_id = node_id
        self.listen = listen
        self.tls = tls  # False: ``--plain`` (loopback only, `kibotos.config.NodeSection`)
        self.socket_dir = Path(os.path.abspath(socket_dir))
        self.control = check_socket_path(control_path(self.socket_dir))
        self.state_dir = state_dir
        self.supervisor = supervisor
        self.python = python or sys.executable
        self.timing = timing or DataplaneTiming()
        self.scope = scope_of(self.socket_dir)
        self.generation: int | None = None
        self.metrics = MetricsSum()
        self.public_key = self._load_public_key()
        self.targets: dict[str, Target] = {}
        self.starts = 0  # generations started by this node process
        self.adopted: int | None = None  # the generation adopted at start, if any
        self.waiting: int | None = None  # the old generation draining its connections
        self._replace_pending: Decision | None = None  # a handover or rebind to retry
        self._replace_at = 0.0
        self._version = 0  # of the wanted state
        self._acked = 0  # the newest version the process confirmed
        self._acked_at_generation: int | None = None
        self._last_push = -1e9
        self._last_metrics = -1e9
        self._push_lock = trio.Lock()
        self._push_failing = False
        self._backoff = Backoff(initial=self.timing.restart_initial, cap=self.timing.restart_cap)

    # ------------------------------------------------------------------ the state

    @property
    def unit(self) -> str | None:
        return None if self.generation is None else unit_name(self.scope, self.generation)

    @property
    def confirmed(self) -> bool:
        """Whether the running process has the latest state."""
        return (self.generation is not None and self._acked >= self._version
                and self._acked_at_generation == self.generation)

    def preload(self, targets: Iterable[Target]) -> None:
        """The targets to hand over with the first state, before `run`: a restarted node
        passes the Instances it reloaded, so an adopted process never serves an empty
        state in between."""
        self.targets = {t.instance_id: t for t in targets}
        self._version += 1

    async def set_public_key(self, key: str) -> bool:
        """ctrl's key from the welcome; persisted, then handed over (≤ confirm time)."""
        parse_public_key(key)
        if key == self.public_key:
            return await self._wait_confirmed()
        self.public_key = key
        await trio.to_thread.run_sync(atomicfile.write_bytes,
                                      self.state_dir / PUBLIC_KEY_FILE, key.encode() + b"\n")
        return await self._changed()

    async def set_targets(self, targets: Iterable[Target]) -> bool:
        wanted = {t.instance_id: t for t in targets}
        if wanted == self.targets:
            return await self._wait_confirmed()
        self.targets = wanted
        return await self._changed()

    async def set_target(self, target: Target) -> bool:
        return await self.set_targets([*(t for i, t in self.targets.items()
                                         if i != target.instance_id), target])

    async def remove_target(self, instance_id: str) -> bool:
        return await self.set_targets(t for i, t in self.targets.items() if i != instance_id)

    async def metrics_text(self) -> str:
        """The sum over every generation this node ran, the current one read now."""
        await self._collect_metrics()
        return self.metrics.render()

    async def _changed(self) -> bool:
        self._version += 1
        return await self._wait_confirmed()

    async def _wait_confirmed(self) -> bool:
        """Push if needed and wait for the ack, at most `confirm_timeout`; the warning
        of the spec when it does not come (the watcher keeps resending).  Before ctrl's
        key is known there is nothing to hand over: no credential could be verified."""
        if self.public_key is None:
            return False
        with trio.move_on_after(self.timing.confirm_timeout):
            while not self.confirmed:
                if not await self._push():
                    await trio.sleep(0.1)
        if self.confirmed:
            return True
        log.warning(NOT_CONFIRMED, generation=self.generation, version=self._version,
                    public_key=self.public_key is not None)
        return False

    async def _push(self) -> bool:
        """Send the whole state to the current process; True when it confirmed."""
        async with self._push_lock:
            generation, version = self.generation, self._version
            if generation is None or self.public_key is None:
                return False
            message = state_message(generation, self.node_id, self.public_key,
                                    self.targets.values())
            self._last_push = trio.current_time()
            try:
                await self._call_current(message)
            except KibotosError as exc:
                if not self._push_failing:
                    log.warning("data-plane state not taken", generation=generation,
                                error=exc.message)
                self._push_failing = True
                return False
            if self._push_failing:
                log.info("data-plane state taken again", generation=generation)
            self._push_failing = False
            if generation == self.generation:
                self._acked, self._acked_at_generation = version, generation
            return True

    def _load_public_key(self) -> str | None:
        path = self.state_dir / PUBLIC_KEY_FILE
        try:
            key = path.read_text(encoding="ascii").strip()
            parse_public_key(key)
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError, InvalidArgument) as exc:
            log.warning("ignoring the saved session signing public key", path=path,
                        error=str(exc))
            return None
        return key

    # ------------------------------------------------------------------ the process

    async def units(self) -> list[UnitInfo]:
        """This node's data-plane units (running or not), by generation."""
        return await UNITS.units(self.supervisor, self.scope)

    async def stop_all(self, *, timeout: float | None = None) -> list[str]:
        """End every data-plane process of this node (each drains first): how access is
        cut off at once, and what a dev cluster's ``down`` does.  Returns the units that
        were running."""
        stopped = await UNITS.stop_all(self.supervisor, self.scope,
                                       timeout=timeout or self.timing.stop_timeout)
        self.generation = self.waiting = None
        return stopped

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Adopt or start the process and hand it state, then watch it until cancelled.
        A start that fails is logged and retried: the node serves on without exec."""
        try:
            await self._adopt_or_start()
        except KibotosError as exc:
            log.error("data-plane process did not start", error=exc.message)
        if self.generation is not None and self.public_key is not None:
            await self._wait_confirmed()
        task_status.started()
        while True:
            await trio.sleep(self.timing.watch_interval)
            await self._watch_once()

    async def _watch_once(self) -> None:
        await self._watch_waiting()
        info = await self.supervisor.describe(self.unit) if self.unit else None
        if info is None or not info.active:
            if self.generation is not None:
                log.warning("data-plane process exited", generation=self.generation,
                            unit=self.unit, result=info.result if info else "unknown")
                self.metrics.exited(self.generation)
                await self.supervisor.stop(self.unit or "", timeout=1.0)  # forget it
                self.generation = None
            await trio.sleep(self._backoff.next_delay())
            try:
                await self._start()
            except KibotosError as exc:
                log.error("data-plane process did not start", error=exc.message)
                return
            await self._push()
            return
        now = trio.current_time()
        pending, old = self._replace_pending, self.generation
        if pending is not None and old is not None and now >= self._replace_at:
            await self._replace(old, pending)
            if self.generation != old:
                await self._push()
            return
        if pending is None:
            self._backoff.reset()
        if not self.confirmed or now - self._last_push >= self.timing.resend_interval:
            await self._push()
        if now - self._last_metrics >= self.timing.metrics_interval:
            await self._collect_metrics()

    async def _collect_metrics(self) -> None:
        """The current generation's counters, and the waiting one's (its connections
        still count while they last)."""
        self._last_metrics = trio.current_time()
        waiting = self.waiting
        if waiting is not None:
            try:
                answer = await listen_handover.call(self._generation_socket(waiting),
                                                    {"type": "metrics"},
                                                    timeout=self.timing.confirm_timeout)
            except KibotosError:
                answer = {}
            if isinstance(answer.get("text"), str) and waiting == self.waiting:
                self.metrics.update(waiting, answer["text"])
        generation = self.generation
        if generation is None:
            return
        try:
            answer = await self._call_current({"type": "metrics"})
        except KibotosError:
            return
        if isinstance(answer.get("text"), str) and generation == self.generation:
            self.metrics.update(generation, answer["text"])

    async def _adopt_or_start(self) -> None:
        units = await self.supervisor.list(f"{UNIT_PREFIX}{self.scope}-")
        found = sorted(((generation_of(u.name, self.scope) or 0, u) for u in units),
                       key=lambda pair: pair[0], reverse=True)
        floor = max([read_generation(self.state_dir / GENERATION_FILE),
                     *(g for g, _ in found)])
        running = []
        for generation, info in found:
            if info.active:
                running.append(generation)
            else:
                await self.supervisor.stop(info.name, timeout=1.0)  # forget the record
        if running:
            await self._keep_one_waiting(running[1:])
            await self._take_running(running[0], floor)
        if self.generation is None:
            await self._start(floor)

    async def _keep_one_waiting(self, older: list[int]) -> None:
        """Older generations still running (newest first): the newest of them may go on
        draining, told to if it is not yet; the others are ended."""
        for generation in older[1:]:
            await self._end(generation, NEWER_DRAINS)
        if older:
            await self._retire(older[0])

    async def _take_running(self, generation: int, floor: int) -> None:
        """Adopt, hand over, rebind or restart the newest running generation."""
        try:
            status = await control_call(self.control, {"type": "status"},
                                        timeout=self.timing.confirm_timeout)
        except KibotosError as exc:
            await self._end(generation, f"it does not answer on its control socket: "
                                        f"{exc.message}")
            return
        if status.get("generation") != generation:
            await self._end(generation, f"the control socket is held by generation "
                                        f"{status.get('generation')}, not {generation}")
            return
        decision = decide(status, build=source_build_id(), listen=self.listen,
                          settings={"tls": self.tls})
        if decision.action == ADOPT:
            self.generation = self.adopted = generation
            log.info("data-plane process adopted", generation=generation,
                     unit=unit_name(self.scope, generation), pid=status.get("pid"))
            return
        if decision.action in (HAND_OVER, REBIND):
            self.generation = generation
            await self._replace(generation, decision, floor)
            return
        if self.waiting is not None:
            await self._end(self.waiting, NEWER_DRAINS)
        await self._end(generation, decision.reason)

    async def _replace(self, old: int, decision: Decision, floor: int = 0) -> None:
        """A new generation takes over from `old` (the listening socket, or the new
        address), then `old` drains.  When the new one does not come up, `old` keeps
        serving and the replacement is tried again (backing off)."""
        log.info("data-plane generation replaced", generation=old, action=decision.action,
                 reason=decision.reason)
        if self.waiting is not None and self.waiting != old:
            await self._end(self.waiting, NEWER_DRAINS)
        try:
            await self._start(floor, take_over_from=old if decision.action == HAND_OVER
                              else None)
        except KibotosError as exc:
            log.error("data-plane handover failed: the old generation keeps serving",
                      generation=old, action=decision.action, error=exc.message)
            self.generation, self._replace_pending = old, decision
            self._replace_at = trio.current_time() + self._backoff.next_delay()
            return
        await self._retire(old)

    async def _call_current(self, message: dict[str, Any]) -> dict[str, Any]:
        """A request to the current generation: on ``control.sock``, or on its own
        generation socket while a failed replacement left an old generation current
        (a successor that died after binding ``control.sock`` took that path)."""
        timeout = self.timing.confirm_timeout
        if self._replace_pending is not None and self.generation is not None:
            return await listen_handover.call(self._generation_socket(self.generation),
                                              message, timeout=timeout)
        return await control_call(self.control, message, timeout=timeout)

    def _generation_socket(self, generation: int) -> Path:
        return listen_handover.generation_path(self.socket_dir, generation)

    async def _retire(self, generation: int) -> None:
        """Let `generation` drain (it stops accepting, exits after its connections);
        one that cannot be told is ended."""
        try:
            await listen_handover.call(self._generation_socket(generation),
                                       {"type": "drain"}, timeout=self.timing.confirm_timeout)
        except KibotosError as exc:
            await self._end(generation, f"it does not drain: {exc.message}")
            return
        self.waiting = generation
        log.info("data-plane generation draining", generation=generation,
                 unit=unit_name(self.scope, generation))

    async def _end(self, generation: int, reason: str) -> None:
        """Stop `generation` (SIGTERM: its 10 s drain, then what is left is closed)."""
        name = unit_name(self.scope, generation)
        log.info("data-plane generation ended", generation=generation, unit=name,
                 reason=reason)
        await self.supervisor.stop(name, timeout=self.timing.stop_timeout)
        self.metrics.exited(generation)
        if self.waiting == generation:
            self.waiting = None
        if self.generation == generation:
            self.generation = None

    async def _watch_waiting(self) -> None:
        """Forget the waiting generation once it exited (its last connection ended)."""
        waiting = self.waiting
        if waiting is None:
            return
        name = unit_name(self.scope, waiting)
        info = await self.supervisor.describe(name)
        if info is not None and info.active:
            return
        log.info("data-plane generation drained", generation=waiting, unit=name,
                 result=info.result if info else "unknown")
        self.metrics.exited(waiting)
        await self.supervisor.stop(name, timeout=1.0)  # forget the record
        if self.waiting == waiting:
            self.waiting = None

    async def _start(self, floor: int | None = None, *, take_over_from: int | None = None
                     ) -> None:
        generation = await UNITS.next_generation(
            self.state_dir, [floor or 0, self.generation or 0, self.waiting or 0])
        name = unit_name(self.scope, generation)
        argv = [self.python, "-m", "kibotos.cli.main", "dataplane", "serve",
                "--listen", self.listen, "--socket-dir", str(self.socket_dir),
                "--generation", str(generation), *([] if self.tls else ["--plain"])]
        if take_over_from is not None:
            argv += ["--take-over-from", str(take_over_from)]
        info = await self.supervisor.start(UnitSpec(
            name=name, argv=argv, properties=UNIT_PROPERTIES,
            environment={"PYTHONUNBUFFERED": "1", **failpoints.environment_for("dataplane.")},
            working_directory=Path("/")))
        self.starts += 1
        serving = await UNITS.wait_serving(
            self.supervisor, name, generation,
            lambda: control_call(self.control, {"type": "status"}, timeout=2.0),
            timeout=self.timing.start_timeout)
        if not serving:
            await self.supervisor.stop(name, timeout=self.timing.stop_timeout)
            raise Unavailable(f"data-plane unit {name} did not start: its control socket did "
                              f"not answer within {self.timing.start_timeout:g}s")
        self.generation = generation
        self._replace_pending = None  # whatever runs now is this node's build and address
        log.info("data-plane process started", generation=generation, unit=name,
                 pid=info.main_pid, listen=self.listen, control=self.control,
                 took_over_from=take_over_from)
