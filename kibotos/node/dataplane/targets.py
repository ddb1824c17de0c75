"""Which Instances the data plane serves, kept in step with the Instance manager.

The data plane serves the RUNNING Instances: a credential names one, and ctrl issues
credentials only for an AVAILABLE Workspace, which it marks so when the node reports
the Instance RUNNING.  So the target must be in the data plane *before* that report
leaves the node (spec: "The node hands the new target … to the data-plane process
before it replies to ctrl").  `DataplaneTargets` does this without the manager or the
session knowing about the data plane:

* `follow` reads the manager's ``instance_state`` frames as they are published and hands
  the data plane the new set of targets (RUNNING in, anything else out);
* `view` wraps the manager for the control session: its `state_feed` hands a frame to
  the session only after `follow` has handed the data plane that frame's change (at
  most the confirmation time: `DataplaneSupervisor` logs the spec's warning and the
  report goes out anyway).

The agent socket of an Instance is ``agent-dp.sock`` in its directory
(``<storage.root>/runtime/instances/<id>/``), which every VMM backend offers there: the
``qemu`` backend as the socket of the guest's second virtio-serial port, the
``firecracker`` backend as a link to its vsock socket, which also needs the guest port
every connection ``CONNECT``s to first (the backend's ``dataplane_vsock_port``; None for
a socket that leads straight to the agent).

With ``[node] dataplane_tls`` (the default) the data plane's certificate is kept beside
it (`kibotos.node.dataplane.certificate`): it starts with the supervisor and asks ctrl
once welcomed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import trio

from kibotos.backends import VmmBackend
from kibotos.config import NodeConfig
from kibotos.core.errors import InvalidArgument
from kibotos.dataplane.process.state import Target
from kibotos.node.dataplane.certificate import CertificateKeeper, CtrlIssuer
from kibotos.node.dataplane.supervisor import DataplaneSupervisor
from kibotos.node.instances.contract import (
    RUNNING,
    CommandHandler,
    Holdings,
    InstanceManager,
    ManagerGauges,
    StateFeed,
)
from kibotos.protocol import Welcome

DATAPLANE_SOCKET = "agent-dp.sock"


def agent_socket(root: Path, instance_id: str) -> Path:
    """The data plane's agent socket of an Instance on the node with `root`."""
    return root / "runtime" / "instances" / instance_id / DATAPLANE_SOCKET


class DataplaneTargets:
    """Follows the manager's states into the data plane; see the module docstring."""

    def __init__(self, manager: InstanceManager, dataplane: DataplaneSupervisor,
                 root: Path, *, vsock_port: int | None = None,
                 certificates: CertificateKeeper | None = None) -> None:
        self.manager = manager
        self.dataplane = dataplane
        self.certificates = certificates
        self.root = root
        self.vsock_port = vsock_port
        self._running: dict[str, str | None] = {}  # instance_id -> workspace_id
        self._synced = 0
        self._synced_changed = trio.Event()
        self._seen = manager.state_feed().position

    @classmethod
    def for_node(cls, config: NodeConfig, manager: InstanceManager, *,
                 registries: Any = None,
                 credential: Callable[[], str | None] = lambda: None) -> DataplaneTargets:
        """The node's data plane, through the supervisor plugin its VMMs use;
        `credential` is the node's, for its certificate requests to ctrl."""
        from kibotos.node.instances.setup import supervisor_options
        from kibotos.plugins import load_plugins

        regs = registries or load_plugins(config.plugins.disable)
        supervisor = regs.supervisor.get(config.supervisor.backend)(supervisor_options(config))
        dataplane = DataplaneSupervisor(
            node_id=config.node.id, listen=config.node.dataplane_listen,
            socket_dir=config.node.socket_dir, state_dir=config.storage.root / "state",
            supervisor=supervisor, tls=config.node.dataplane_tls)
        certificates = CertificateKeeper(
            state_dir=config.storage.root / "state", control=dataplane.control,
            issue=CtrlIssuer(config.node.ctrl_urls, credential, config.node.ctrl_tls())) \
            if config.node.dataplane_tls else None
        backend: VmmBackend = regs.vmm.get(config.vmm.backend)(config.vmm.options())
        return cls(manager, dataplane, config.storage.root,
                   vsock_port=backend.dataplane_vsock_port, certificates=certificates)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Preload the targets, adopt or start the data plane and hand it the state,
        then follow the manager; `started` once the first state was handed over (or the
        confirmation time passed), so the node says hello to ctrl only after."""
        self.preload()
        async with trio.open_nursery() as nursery:
            if self.certificates is not None:
                await nursery.start(self.certificates.run)
            await nursery.start(self.dataplane.run)
            await nursery.start(self.follow)
            task_status.started()

    async def on_welcome(self, welcome: Welcome) -> None:
        """ctrl's public key, handed to the data plane before the node goes on; and
        ctrl now knows the data-plane address, so the certificate can be asked for."""
        if self.certificates is not None:
            self.certificates.on_welcome()
        key = welcome.session_signing_public_key
        if key is None:
            return  # a ctrl that issues no credentials
        try:
            await self.dataplane.set_public_key(key)
        except InvalidArgument as exc:
            from kibotos.core.logs import EventLogger

            EventLogger().error("ctrl sent an unusable session signing public key",
                                error=exc.message)

    def preload(self) -> None:
        """The RUNNING Instances the manager has now (it reloaded its records), handed
        over with the data plane's first state; call before `DataplaneSupervisor.run`."""
        feed = self.manager.state_feed()
        self._seen = self._synced = feed.position
        self._running = {i.instance_id: i.workspace_id
                         for i in self.manager.holdings().instances if i.state == RUNNING}
        self.dataplane.preload(self._targets())

    def _targets(self) -> list[Target]:
        return [Target(iid, agent_socket(self.root, iid), ws, self.vsock_port)
                for iid, ws in sorted(self._running.items())]

    async def follow(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                     ) -> None:
        """Until cancelled: each batch of frames becomes one new target set."""
        feed = self.manager.state_feed()
        task_status.started()
        while True:
            position, frames = await feed.after(self._seen)
            self._seen = position
            before = dict(self._running)
            for frame in frames:
                iid = frame.get("instance_id")
                if not isinstance(iid, str):
                    continue
                if frame.get("state") == RUNNING:
                    ws = frame.get("workspace_id")
                    self._running[iid] = ws if isinstance(ws, str) else None
                else:
                    self._running.pop(iid, None)
            if self._running != before:
                await self.dataplane.set_targets(self._targets())
            self._synced = position
            self._synced_changed.set()
            self._synced_changed = trio.Event()

    async def wait_synced(self, position: int) -> None:
        """Until `follow` handled every frame up to `position` (bounded: a stuck data
        plane must not hold back the node's reports for long)."""
        with trio.move_on_after(self.dataplane.timing.confirm_timeout + 1.0):
            while self._synced < position:
                await self._synced_changed.wait()

    def view(self) -> InstanceManager:
        """The manager as the control session should see it."""
        return _GatedManager(self.manager, _GatedFeed(self.manager.state_feed(), self))


class _GatedFeed(StateFeed):
    """The manager's feed, released to the session only once the data plane has it."""

    def __init__(self, inner: StateFeed, targets: DataplaneTargets) -> None:
        super().__init__(keep=1)
        self._inner = inner
        self._targets = targets

    @property
    def position(self) -> int:
        return self._inner.position

    def publish(self, frame: dict[str, Any]) -> None:
        self._inner.publish(frame)

    async def after(self, seen: int) -> tuple[int, list[dict[str, Any]]]:
        position, frames = await self._inner.after(seen)
        await self._targets.wait_synced(position)
        return position, frames


class _GatedManager:
    """The Instance manager with the gated feed; everything else is the manager's."""

    def __init__(self, inner: InstanceManager, feed: _GatedFeed) -> None:
        self._inner = inner
        self._feed = feed

    def state_feed(self) -> StateFeed:
        return self._feed

    def set_change_callback(self, callback: Callable[[], None]) -> None:
        self._inner.set_change_callback(callback)

    def holdings(self) -> Holdings:
        return self._inner.holdings()

    def command_handlers(self) -> Mapping[str, CommandHandler]:
        return self._inner.command_handlers()

    def set_drain_requested(self, requested: bool) -> None:
        self._inner.set_drain_requested(requested)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        await self._inner.run(task_status=task_status)

    async def destroy_all(self) -> int:
        return await self._inner.destroy_all()

    def vm_usage(self) -> tuple[float | None, int | None]:
        return self._inner.vm_usage()

    def gauges(self) -> ManagerGauges:
        return self._inner.gauges()
