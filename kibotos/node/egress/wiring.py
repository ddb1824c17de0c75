"""The egress processes wired into the node: `NodeEgress` is the Instance network's
`kibotos.node.instances.network_step.EgressService`, over the `EgressSupervisor`.

Why a seam and not a call: the Instance lifecycle sits a layer below the node's
process supervisors (docs/architecture.md, "Layout and layer order"), as it does for
the data plane; the node's serve builds this, hands it to the network step and runs it
beside the manager.

* **At node start** (`run`): the Instances to serve come from the network records
  alone, the policy in force or, for a switch a crash left half done, the one being
  switched to (adoption finishes it); the supervisor is given them before it adopts or
  starts a process, so an adopted process never serves an empty state and the
  credentials come from their files alone (spec: "restores egress from these files
  only").  Records of namespaces that are gone are skipped: nothing could be served.
* **serve**: the supervisor gets the Instance; when its process cannot confirm at once
  (it just died, or is starting), this waits for the supervisor's own restart, at most
  `serve_timeout`; then it raises and the boot or switch fails, never sent direct.
* **release**: the Instance leaves the state: the process closes its sockets, and the
  credentials no other Instance references are deleted at once.

Every call waits until `run` has adopted or started the process, so a command can never
start a second generation beside the one being adopted.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from kibotos.config import NodeConfig
from kibotos.core.errors import FailedPrecondition, InvalidArgument, KibotosError, Unavailable
from kibotos.core.logs import EventLogger
from kibotos.node.egress.credentials import CredentialClient, CredentialStore
from kibotos.node.egress.listeners import EgressInstance
from kibotos.node.egress.supervisor import EgressSupervisor, EgressTiming
from kibotos.node.instances.network_step import NetworkStep
from kibotos.node.network import netns as ns
from kibotos.node.network.policy import NetworkPolicy, to_record
from kibotos.node.network.records import NetworkRecord, NetworkRecords

if TYPE_CHECKING:
    from kibotos.plugins import Registries

log = EventLogger()


class NodeEgress:
    """See the module docstring."""

    def __init__(self, supervisor: EgressSupervisor, records: NetworkRecords, *,
                 netns_dir: Path, no_ctrl: str | None = None,
                 serve_timeout: float | None = None) -> None:
        self.supervisor = supervisor
        self.records = records
        self.netns_dir = netns_dir
        #: Why credentials cannot be fetched from ctrl (its URL), or None.
        self.no_ctrl = no_ctrl
        timing = supervisor.timing
        self.serve_timeout = serve_timeout if serve_timeout is not None else \
            timing.start_timeout + timing.restart_cap
        self._ready = trio.Event()

    @classmethod
    def for_node(cls, config: NodeConfig, step: NetworkStep, *,
                 credential: Callable[[], str | None], ctrl_url: str | None = None,
                 registries: Registries | None = None, python: str | None = None,
                 environment: Mapping[str, str] | None = None,
                 timing: EgressTiming | None = None) -> NodeEgress:
        """The node's egress, through the supervisor plugin its VMMs use; credentials
        from ctrl (`ctrl_url`, default the node's) with the node's own identity, ctrl
        verified against ``[node] ctrl_ca_file`` as the node's session does."""
        from kibotos.node.instances.setup import supervisor_options
        from kibotos.plugins import load_plugins

        assert config.network is not None, "egress needs [network]"
        regs = registries or load_plugins(config.plugins.disable)
        supervisor = regs.supervisor.get(config.supervisor.backend)(supervisor_options(config))
        client: CredentialClient | None = None
        no_ctrl = None
        try:
            client = CredentialClient(ctrl_url or config.node.ctrl_urls, credential,
                                      verify=config.node.ctrl_tls())
        except InvalidArgument as exc:  # http:// off loopback, or an unreadable CA file
            no_ctrl = exc.message
        state_dir = config.storage.root / "state"
        egress = EgressSupervisor(
            socket_dir=config.node.socket_dir, storage_root=config.storage.root,
            supervisor=supervisor, resolvers=config.network.resolvers,
            credentials=CredentialStore(state_dir, client),
            host_netns=config.testing.network_host_netns, netns_dir=step.netns_dir,
            python=python, environment=environment, timing=timing)
        return cls(egress, step.records, netns_dir=step.netns_dir, no_ctrl=no_ctrl)

    # ------------------------------------------------------------------ node start

    def recorded(self) -> list[EgressInstance]:
        """The Instances the network records say an egress process serves (blocking)."""
        found = []
        try:
            names = sorted(os.listdir(self.records.directory))
        except FileNotFoundError:
            return []
        for name in names:
            if name.startswith(".") or not name.endswith(".json"):
                continue
            try:
                record = self.records.read(name.removesuffix(".json"))
                instance = None if record is None else EgressInstance.from_record(
                    record, netns_dir=self.netns_dir,
                    pending=record.pending_policy is not None)
            except KibotosError as exc:  # check-maintenance reports a damaged record
                log.error("network record not served by the egress process", record=name,
                          error=exc.message)
                continue
            if instance is not None and ns.is_netns(instance.netns):
                found.append(instance)
        return found

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Preload from the records, adopt or start the process, then watch it."""
        instances = await trio.to_thread.run_sync(self.recorded)
        self.supervisor.preload(instances)
        if instances:
            log.info("egress instances reloaded", count=len(instances))
        async with trio.open_nursery() as nursery:
            await nursery.start(self.supervisor.run)
            self._ready.set()
            task_status.started()

    # ------------------------------------------------------------------ EgressService

    async def _wait_ready(self) -> bool:
        """Whether `run` adopted or started the process (bounded: a node whose egress
        never started must not hang its Instances' commands)."""
        with trio.move_on_after(self.serve_timeout):
            await self._ready.wait()
        return self._ready.is_set()

    async def serve(self, record: NetworkRecord, policy: NetworkPolicy) -> None:
        if not await self._wait_ready():
            raise Unavailable(f"Instance {record.instance_id}: the node's egress processes "
                              "were not taken over yet")
        wanted = dataclasses.replace(record, policy=to_record(policy), pending_policy=None,
                                     pending_revision=None)
        instance = EgressInstance.from_record(wanted, netns_dir=self.netns_dir)
        if instance is None:
            raise FailedPrecondition(f"Instance {record.instance_id}: its policy names no "
                                     "Egress or Resolver")
        ref = instance.egress
        if ref is not None and ref.authenticated and self.no_ctrl is not None and \
                await trio.to_thread.run_sync(self.supervisor.store.load, ref.name,
                                              ref.revision) is None:
            raise FailedPrecondition(f"Instance {record.instance_id}: the credentials of "
                                     f"egress {ref.name} cannot be fetched: "
                                     f"{self.no_ctrl}")
        if await self.supervisor.set_instance(instance):
            return
        with trio.move_on_after(self.serve_timeout):
            while not self.supervisor.confirmed:
                await trio.sleep(0.1)
            return
        raise Unavailable(f"Instance {record.instance_id}: no egress process took its "
                          f"policy within {self.serve_timeout:g}s (the node log says why: "
                          "egress process did not start, or egress state not taken)")

    async def release(self, instance_id: str) -> None:
        if not await self._wait_ready():
            log.warning("egress process not told an Instance left: the node's egress "
                        "processes were not taken over yet", instance_id=instance_id)
            return
        if not await self.supervisor.remove_instance(instance_id):
            log.warning("egress process not told an Instance left", instance_id=instance_id)
