"""The node's side of its egress processes: start, adopt, hand over, drain, restart.

An egress process (``kibotos egress serve``, `kibotos.egress`) runs only while some
Instance's policy on this node references an Egress or a Resolver (`EgressInstance`).
The node hands it, over its control socket, the routing state with the credentials of
the Egress revisions in use (`kibotos.node.egress.credentials`: files, fetched from ctrl
only when missing) and each Instance's sockets, which the node opens inside the
Instance's namespace (`kibotos.node.egress.listeners`) and keeps no copy of.

Generations (spec: "Egress processes"), numbered in ``<storage.root>/state/
egress-generation`` before each start; at most two run:

* at node start, a running generation of the same build is adopted (connections kept);
  one of another build on the same release line is replaced: a new generation starts,
  takes the old one's sockets (checked, `listeners.verify`) and the state, and the old
  one drains (stops accepting and reading, drops its credentials, answers what it
  received within 4 s, keeps its tunnels until `EgressTiming.drain_deadline`, exits when
  they end); across release lines the old one is ended and its connections drop;
* a generation already draining when another must drain is ended first, logged
  ``egress generation ended`` with ``reason=a newer generation is about to drain``;
* when no policy references an Egress or Resolver any more, the current generation
  drains and exits by itself;
* when the current generation dies, a new one starts within a few seconds (backing off
  while starts keep failing) with fresh sockets; until then the guest's redirected
  connections are refused, never sent direct.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from kibotos.backends import Supervisor, UnitInfo, UnitSpec
from kibotos.core.errors import KibotosError, Unavailable
from kibotos.core.logs import EventLogger
from kibotos.egress import wire
from kibotos.egress.build import source_build_id
from kibotos.node.dataplane.supervisor import scope_of
from kibotos.node.egress import units
from kibotos.node.egress.credentials import Credential, CredentialStore, Key
from kibotos.node.egress.listeners import EgressInstance, close_all, open_sockets, verify
from kibotos.node.network.names import NETNS_DIR
from kibotos.node.runtime.build_identity import same_release_line
from kibotos.node.session.backoff import Backoff

log = EventLogger()

#: The spec's log line and reason when a third generation would run.
ENDED = "egress generation ended"
NEWER_DRAINS = "a newer generation is about to drain"


@dataclass(frozen=True)
class EgressTiming:
    confirm_timeout: float = 5.0  # one control request
    watch_interval: float = 1.0  # how often the units are looked at
    resend_interval: float = 30.0  # a full resend of the state even when nothing changed
    start_timeout: float = 30.0  # unit start to its control socket answering
    stop_timeout: float = 5.0  # SIGTERM ends it at once; SIGKILL after this
    restart_initial: float = 1.0
    restart_cap: float = 10.0
    drain_deadline: float = 3600.0  # how long a draining generation keeps its tunnels
    drain_grace: float = 30.0  # past its deadline, a draining process is ended


@dataclass
class _Generation:
    number: int
    unit: str
    control: Path
    build: str = ""
    draining: bool = False
    drain_until: float | None = None  # trio time


class EgressSupervisor:
    """See the module docstring.  `run` in the node's nursery; `set_instance` and
    `remove_instance` as Instances start, switch their policy and end."""

    def __init__(self, *, socket_dir: Path, storage_root: Path, supervisor: Supervisor,
                 resolvers: Iterable[str], credentials: CredentialStore,
                 host_netns: Path | None = None, netns_dir: Path = NETNS_DIR,
                 user: str = units.USER, python: str | None = None,
                 environment: Mapping[str, str] | None = None,
                 timing: EgressTiming | None = None) -> None:
        socket_dir = Path(os.path.abspath(socket_dir))
        self.socket_dir = socket_dir
        self.scope = scope_of(socket_dir)
        self.egress_dir = wire.socket_dir_of(socket_dir)
        self.storage_root = storage_root
        self.state_dir = storage_root / "state"
        self.supervisor = supervisor
        self.resolvers = list(resolvers)
        self.store = credentials
        self.host_netns = host_netns
        self.netns_dir = netns_dir
        self.user = user
        self.python = python or sys.executable
        self.environment = dict(environment or {})
        self.timing = timing or EgressTiming()
        self.instances: dict[str, EgressInstance] = {}
        self.credentials: dict[Key, Credential] = {}
        self.current: _Generation | None = None
        self.draining: _Generation | None = None
        self.adopted: int | None = None
        self.starts = 0
        self._lock = trio.Lock()
        self._version = 0  # of the wanted state
        self._pushed: tuple[int, int] | None = None  # (generation, version) confirmed
        self._last_push = -1e9
        self._restart_at = 0.0
        self._backoff = Backoff(initial=self.timing.restart_initial,
                                cap=self.timing.restart_cap)

    # ------------------------------------------------------------------ the wanted state

    @property
    def confirmed(self) -> bool:
        current = self.current
        return current is not None and self._pushed == (current.number, self._version)

    def preload(self, instances: Iterable[EgressInstance]) -> None:
        """The Instances a restarted node reloaded, before `run`: the egress process is
        adopted with them, and their credentials come from the files alone."""
        for instance in instances:
            self.instances[instance.instance_id] = instance
        self._version += 1

    async def set_instance(self, instance: EgressInstance) -> bool:
        """An Instance's policy now references `instance.egress` / `.resolver`: its
        credentials are on disk (fetched if needed: a failure raises, nothing changed)
        and the process has its routes and sockets when this returns True."""
        if instance.egress is not None and instance.egress.authenticated:
            ref = instance.egress
            credential = await self.store.ensure(ref.name, ref.revision)
            self.credentials[credential.key] = credential
        self.instances[instance.instance_id] = instance
        self._version += 1
        return await self._sync()

    async def remove_instance(self, instance_id: str) -> bool:
        """The Instance ended or its policy no longer references an Egress or Resolver;
        credentials nothing references any more are deleted at once."""
        if self.instances.pop(instance_id, None) is None:
            return True
        self._version += 1
        return await self._sync()

    def referenced(self) -> set[Key]:
        return {(i.egress.name, i.egress.revision) for i in self.instances.values()
                if i.egress is not None and i.egress.authenticated}

    async def _retain_credentials(self) -> None:
        keep = self.referenced()
        for key in [k for k in self.credentials if k not in keep]:
            del self.credentials[key]
        await trio.to_thread.run_sync(self.store.retain_only, keep)

    async def _restore_credentials(self) -> None:
        """At start: the referenced revisions from their files; ctrl is asked only for
        one whose file is missing (an error there leaves that Egress failing closed)."""
        for name, revision in sorted(self.referenced()):
            try:
                credential = await self.store.ensure(name, revision)
            except KibotosError as exc:
                log.error("egress credentials missing", egress=name, revision=revision,
                          error=exc.message)
                continue
            self.credentials[credential.key] = credential

    def state_body(self, generation: int) -> dict[str, Any]:
        """The ``state`` request for `generation` (it carries the credentials)."""
        instances = []
        for instance in self.instances.values():
            egress: dict[str, Any] | None = None
            ref = instance.egress
            if ref is not None:
                credential = self.credentials.get((ref.name, ref.revision))
                if not ref.authenticated or credential is not None:
                    egress = {"name": ref.name, "revision": ref.revision,
                              "address": ref.address,
                              "username": credential.username if credential else None,
                              "password": credential.password if credential else None}
            resolver = None if instance.resolver is None else {
                "name": instance.resolver.name, "revision": instance.resolver.revision,
                "upstream": instance.resolver.upstream,
                "via_egress": instance.resolver.via_egress}
            if resolver is not None and resolver["via_egress"] and egress is None:
                resolver = None  # its Egress cannot be used: no answer, never direct
            instances.append({"instance_id": instance.instance_id,
                              "guest": list(instance.guests), "egress": egress,
                              "resolver": resolver, "roles": instance.roles})
        return {"type": "state", "generation": generation, "resolvers": self.resolvers,
                "instances": instances}

    # ------------------------------------------------------------------ talking to it

    async def _call(self, generation: _Generation, body: dict[str, Any],
                    fds: list[int] | None = None) -> wire.Message:
        return await wire.call(generation.control, body, fds or [],
                               timeout=self.timing.confirm_timeout)

    async def _push(self, generation: _Generation) -> bool:
        version = self._version
        try:
            await self._call(generation, self.state_body(generation.number))
        except KibotosError as exc:
            log.warning("egress state not taken", generation=generation.number,
                        error=exc.message)
            return False
        self._last_push = trio.current_time()
        if generation is self.current:
            self._pushed = (generation.number, version)
        return True

    async def _give_sockets(self, generation: _Generation, instance: EgressInstance,
                            roles: list[str]) -> None:
        """Open fresh sockets for `roles` of `instance` and hand them to `generation`."""
        opened = await trio.to_thread.run_sync(open_sockets, instance, roles)
        try:
            await self._call(generation, {"type": "sockets",
                                          "instance_id": instance.instance_id,
                                          "roles": roles}, [s.fileno() for s in opened])
        finally:
            close_all(opened)  # the process has its own copies now; the node keeps none

    async def _take_sockets(self, source: _Generation, instance: EgressInstance,
                            wanted: list[str]) -> dict[str, int]:
        """Copies of `instance`'s sockets from `source`, only those that pass `verify`;
        the rest are closed."""
        try:
            answer = await self._call(source, {"type": "give-sockets",
                                               "instance_id": instance.instance_id})
        except KibotosError as exc:
            log.warning("egress sockets not taken over", generation=source.number,
                        instance_id=instance.instance_id, error=exc.message)
            return {}
        roles = answer.body.get("roles")
        taken: dict[str, int] = {}
        if not isinstance(roles, list) or len(roles) != len(answer.fds):
            answer.close_fds()
            return {}
        for role, fd in zip(roles, answer.fds, strict=True):
            sock = socket.socket(fileno=fd)
            problem = verify(instance, role, sock) if role in wanted else "not wanted"
            if problem is None and role not in taken:
                taken[role] = sock.detach()
            else:
                log.warning("egress socket not taken over", generation=source.number,
                            instance_id=instance.instance_id, role=role, problem=problem)
                sock.close()
        return taken

    async def _sync_sockets(self, generation: _Generation,
                            source: _Generation | None = None) -> None:
        try:
            status = (await self._call(generation, {"type": "status"})).body
        except KibotosError as exc:
            log.warning("egress status not read", generation=generation.number,
                        error=exc.message)
            return
        held = status.get("sockets") if isinstance(status.get("sockets"), dict) else {}
        assert isinstance(held, dict)
        for instance in list(self.instances.values()):
            missing = [r for r in instance.roles if r not in held.get(instance.instance_id, [])]
            if not missing:
                continue
            try:
                taken = await self._take_sockets(source, instance, missing) \
                    if source is not None else {}
                if taken:
                    fds = list(taken.values())
                    try:
                        await self._call(generation, {
                            "type": "sockets", "instance_id": instance.instance_id,
                            "roles": list(taken)}, fds)
                    finally:
                        for fd in fds:
                            os.close(fd)
                rest = [r for r in missing if r not in taken]
                if rest:
                    await self._give_sockets(generation, instance, rest)
            except KibotosError as exc:
                log.error("egress sockets not handed over", generation=generation.number,
                          instance_id=instance.instance_id, error=exc.message)

    # ------------------------------------------------------------------ generations

    async def _start(self) -> _Generation:
        number = await units.UNITS.next_generation(
            self.state_dir, [g.number for g in (self.current, self.draining) if g])
        owner = units.account(self.user)
        await trio.to_thread.run_sync(units.prepare_socket_dir, self.egress_dir, owner)
        name = units.unit_name(self.scope, number)
        generation = _Generation(number, name, wire.control_path(self.egress_dir, number),
                                 build=source_build_id())
        argv = [self.python, "-m", "kibotos.cli.main", "egress", "serve",
                "--socket-dir", str(self.egress_dir), "--generation", str(number)]
        info = await self.supervisor.start(UnitSpec(
            name=name, argv=argv, working_directory=Path("/"),
            properties=units.unit_properties(egress_dir=self.egress_dir,
                                             storage_root=self.storage_root,
                                             user=self.user, host_netns=self.host_netns),
            environment={"PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
                         **self.environment}))
        self.starts += 1
        serving = await units.UNITS.wait_serving(
            self.supervisor, name, number,
            lambda: self._call_body(generation, {"type": "status"}, 2.0),
            timeout=self.timing.start_timeout)
        if not serving:
            await self.supervisor.stop(name, timeout=self.timing.stop_timeout)
            raise Unavailable(f"egress unit {name} did not answer on {generation.control} "
                              f"within {self.timing.start_timeout:g}s (see the unit's log)")
        log.info("egress process started", generation=number, unit=name, pid=info.main_pid,
                 user=self.user)
        return generation

    async def _call_body(self, generation: _Generation, body: dict[str, Any],
                         timeout: float) -> dict[str, Any]:
        return (await wire.call(generation.control, body, timeout=timeout)).body

    async def _end(self, generation: _Generation, reason: str) -> None:
        log.info(ENDED, generation=generation.number, unit=generation.unit, reason=reason)
        await self.supervisor.stop(generation.unit, timeout=self.timing.stop_timeout)
        if generation is self.current:
            self.current = None
        if generation is self.draining:
            self.draining = None

    async def _retire(self, generation: _Generation) -> None:
        """Let `generation` drain; the one already draining is ended first."""
        if self.draining is not None and self.draining is not generation:
            await self._end(self.draining, NEWER_DRAINS)
        deadline = self.timing.drain_deadline
        try:
            await self._call(generation, {"type": "drain", "deadline": deadline})
        except KibotosError as exc:
            await self._end(generation, f"it does not drain: {exc.message}")
            return
        generation.draining = True
        generation.drain_until = trio.current_time() + deadline
        if generation is self.current:
            self.current = None
        self.draining = generation
        log.info("egress generation draining", generation=generation.number,
                 unit=generation.unit, deadline=f"{deadline:g}s")

    async def _replace(self, old: _Generation) -> None:
        """A new generation takes over from `old` (same release line, another build)."""
        if self.draining is not None and self.draining is not old:
            await self._end(self.draining, NEWER_DRAINS)
        new = await self._start()
        self.current = new
        if await self._push(new):
            await self._sync_sockets(new, source=old)
        await self._retire(old)

    async def _status(self, info: UnitInfo, number: int) -> dict[str, Any] | str:
        """The running unit's status, or why it is not usable."""
        control = wire.control_path(self.egress_dir, number)
        try:
            status = (await wire.call(control, {"type": "status"},
                                      timeout=self.timing.confirm_timeout)).body
        except KibotosError as exc:
            return f"it does not answer on its control socket: {exc.message}"
        if status.get("generation") != number:
            return f"its control socket answers as generation {status.get('generation')}"
        return status

    async def _adopt_or_start(self) -> None:
        found = await units.UNITS.units(self.supervisor, self.scope)
        running: list[_Generation] = []
        for info in reversed(found):  # the newest first
            number = units.generation_of(info.name, self.scope) or 0
            generation = _Generation(number, info.name,
                                     wire.control_path(self.egress_dir, number))
            if not info.active:
                await self.supervisor.stop(info.name, timeout=1.0)  # forget the record
                continue
            status = await self._status(info, number)
            if isinstance(status, str):
                await self._end(generation, status)
                continue
            generation.build = str(status.get("build"))
            generation.draining = status.get("draining") is True
            remaining = status.get("drain_remaining")
            if generation.draining and isinstance(remaining, int | float):
                generation.drain_until = trio.current_time() + float(remaining)
            running.append(generation)
        candidate = next((g for g in running if not g.draining), None)
        older = [g for g in running if g is not candidate]
        build = source_build_id()
        for extra in older[1:]:  # at most one older generation stays, draining
            await self._end(extra, NEWER_DRAINS)
        if older:
            self.draining = older[0]
            if not older[0].draining:
                await self._retire(older[0])
        if candidate is None:
            return
        if candidate.build == build:
            self.current, self.adopted = candidate, candidate.number
            log.info("egress process adopted", generation=candidate.number,
                     unit=candidate.unit)
        elif not same_release_line(candidate.build, build):
            await self._end(candidate, f"another release line ({candidate.build}; this node "
                                       f"would start {build})")
        elif self.instances:
            log.info("egress generation replaced", generation=candidate.number,
                     reason=f"another build ({candidate.build}; this node starts {build})")
            await self._replace(candidate)
        else:
            await self._retire(candidate)
        if self.draining is not None and not same_release_line(self.draining.build,
                                                                     build):
            await self._end(self.draining, f"another release line ({self.draining.build})")

    async def _sync(self) -> bool:
        """Bring the processes to the wanted state: start, push, hand sockets, retire."""
        async with self._lock:
            try:
                if not self.instances:
                    if self.current is not None:
                        await self._retire(self.current)
                    return True
                if self.current is None:
                    if trio.current_time() < self._restart_at:
                        return False
                    try:
                        self.current = await self._start()
                    except KibotosError as exc:
                        log.error("egress process did not start", error=exc.message)
                        self._restart_at = trio.current_time() + self._backoff.next_delay()
                        return False
                if not await self._push(self.current):
                    return False
                await self._sync_sockets(self.current)
                return self.confirmed
            finally:
                await self._retain_credentials()

    # ------------------------------------------------------------------ watching

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Adopt, replace or start, then watch until cancelled."""
        await self._restore_credentials()
        try:
            async with self._lock:
                await self._adopt_or_start()
        except KibotosError as exc:
            log.error("egress processes not taken over", error=exc.message)
        await self._sync()
        task_status.started()
        while True:
            await trio.sleep(self.timing.watch_interval)
            await self._watch_once()

    async def _watch_once(self) -> None:
        now = trio.current_time()
        async with self._lock:
            current = self.current
            if current is not None:
                info = await self.supervisor.describe(current.unit)
                if info is None or not info.active:
                    log.warning("egress process exited", generation=current.number,
                                unit=current.unit,
                                result=info.result if info else "unknown")
                    await self.supervisor.stop(current.unit, timeout=1.0)  # forget it
                    self.current = None
                    self._restart_at = now + self._backoff.next_delay()
                else:
                    self._backoff.reset()
            draining = self.draining
            if draining is not None:
                info = await self.supervisor.describe(draining.unit)
                if info is None or not info.active:
                    log.info(ENDED, generation=draining.number, unit=draining.unit,
                             reason="drained: its last connection ended or expired")
                    await self.supervisor.stop(draining.unit, timeout=1.0)
                    self.draining = None
                elif draining.drain_until is not None and \
                        now > draining.drain_until + self.timing.drain_grace:
                    await self._end(draining, "still running after its drain deadline")
        if self.instances and (self.current is None or not self.confirmed
                               or now - self._last_push >= self.timing.resend_interval):
            await self._sync()

    async def stop_all(self, *, timeout: float | None = None) -> list[str]:
        """End every egress process of this node (their connections drop)."""
        async with self._lock:
            stopped = await units.stop_units(self.supervisor, self.socket_dir,
                                             timeout=timeout or self.timing.stop_timeout)
            self.current = self.draining = None
            return stopped
