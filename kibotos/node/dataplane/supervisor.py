"""The node's side of its data-plane process: start or adopt it, hand it state, restart it.

The data plane (``kibotos dataplane serve``, `kibotos.dataplane`) runs as its own unit,
``kibotos-dataplane-<scope>-<generation>``, through the node's supervisor plugin, so it
outlives node restarts (spec: node-and-vmm-processes, "Data-plane processes").  The
scope is derived from the node's socket directory, so several nodes on one host never
touch each other's processes; the generation grows by one on every start and is
persisted in ``<storage.root>/state/dataplane-generation`` before the unit starts.

At node start, a running data-plane process of this scope is *adopted* when it answers
on its control socket as the generation its unit name says, with the same build
(`kibotos.dataplane.build.build_id`) and the same listen address: its connections are
not affected.  Any other running one is stopped first (its connections get the
process's drain), then a new generation starts.  The handover across builds without
dropping connections is a later step.

State: the node hands over the whole state (ctrl's public key, node ID, the running
Instances' data-plane agent sockets) on every change and waits for the ack, at most
`confirm_timeout` (5 s); without it, it logs the spec's warning and goes on, and keeps
resending every `watch_interval` until the process confirms (the spec allows 15 s).
ctrl's public key is kept in ``<storage.root>/state/session-signing-public-key``, so a
restarted node can hand over state before ctrl answers.  When the process exits, a new
generation starts within a few seconds (backing off while it keeps failing), and the
counters it had are kept in the node's sum (`kibotos.dataplane.metrics.MetricsSum`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from kibotos import atomicfile
from kibotos.backends import Supervisor, UnitInfo, UnitSpec
from kibotos.credentials import parse_public_key
from kibotos.dataplane.build import source_build_id
from kibotos.dataplane.control import check_socket_path, control_call, control_path
from kibotos.dataplane.metrics import MetricsSum
from kibotos.dataplane.state import Target, state_message
from kibotos.errors import InvalidArgument, KibotosError, Unavailable
from kibotos.logs import EventLogger
from kibotos.node.network.names import node_scope
from kibotos.node.runtime.process_units import ProcessUnits
from kibotos.node.session.backoff import Backoff

log = EventLogger()

UNIT_PREFIX = "kibotos-dataplane-"
GENERATION_FILE = "dataplane-generation"
PUBLIC_KEY_FILE = "session-signing-public-key"
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
                await control_call(self.control, message, timeout=self.timing.confirm_timeout)
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
        self.generation = None
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
        self._backoff.reset()
        now = trio.current_time()
        if not self.confirmed or now - self._last_push >= self.timing.resend_interval:
            await self._push()
        if now - self._last_metrics >= self.timing.metrics_interval:
            await self._collect_metrics()

    async def _collect_metrics(self) -> None:
        generation = self.generation
        if generation is None:
            return
        self._last_metrics = trio.current_time()
        try:
            answer = await control_call(self.control, {"type": "metrics"},
                                        timeout=self.timing.confirm_timeout)
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
        for generation, info in found:
            if not info.active:
                await self.supervisor.stop(info.name, timeout=1.0)  # forget the record
                continue
            reason = "an older generation" if self.generation is not None else \
                await self._why_not_adoptable(generation)
            if reason is None:
                self.generation = self.adopted = generation
                log.info("data-plane process adopted", generation=generation,
                         unit=info.name, pid=info.main_pid)
                continue
            log.info("data-plane generation ended", generation=generation, unit=info.name,
                     reason=reason)
            await self.supervisor.stop(info.name, timeout=self.timing.stop_timeout)
        if self.generation is None:
            await self._start(floor)

    async def _why_not_adoptable(self, generation: int) -> str | None:
        try:
            status = await control_call(self.control, {"type": "status"},
                                        timeout=self.timing.confirm_timeout)
        except KibotosError as exc:
            return f"it does not answer on its control socket: {exc.message}"
        if status.get("generation") != generation:
            return (f"the control socket is held by generation {status.get('generation')}, "
                    f"not {generation}")
        build = source_build_id()
        if status.get("build") != build:
            return f"another build ({status.get('build')}; this node would start {build})"
        if status.get("tls", False) is not self.tls:
            return f"the TLS setting changed (tls {status.get('tls')} -> {self.tls})"
        if status.get("configured_listen") != self.listen:
            return (f"the listen address changed ({status.get('configured_listen')} -> "
                    f"{self.listen})")
        return None

    async def _start(self, floor: int | None = None) -> None:
        generation = await UNITS.next_generation(
            self.state_dir, [floor or 0, self.generation or 0])
        name = unit_name(self.scope, generation)
        argv = [self.python, "-m", "kibotos.cli.main", "dataplane", "serve",
                "--listen", self.listen, "--socket-dir", str(self.socket_dir),
                "--generation", str(generation), *([] if self.tls else ["--plain"])]
        info = await self.supervisor.start(UnitSpec(
            name=name, argv=argv, properties=UNIT_PROPERTIES,
            environment={"PYTHONUNBUFFERED": "1"}, working_directory=Path("/")))
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
        log.info("data-plane process started", generation=generation, unit=name,
                 pid=info.main_pid, listen=self.listen, control=self.control)
