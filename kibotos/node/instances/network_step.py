"""An Instance's network as a step of its life: made before its VMM starts, switched
while it runs, rewritten at adoption, removed after its VMM's cgroup is empty.

The work is `kibotos.node.network`'s (tested there as a library); this module is the
node's use of it, one `NetworkStep` per node with ``[network]``:

* **admission** (`refusal`): a create whose policy this node cannot enforce, or that
  names an Egress or a Resolver while no egress process serves the node's Instances
  (`egress` is None), is refused before anything is written (a node without
  ``[network]`` refuses every ``network``, `kibotos.node.instances.manager`);
* **setup** (`setup`): the network record (the slot, the policy and its revision), then
  namespace, veth, tap (owned by the VMM account when the backend names one), addresses,
  routes and the slot table, then, for a policy naming an Egress or a Resolver, the
  egress process given the Instance (`EgressService.serve`: its credentials and the
  sockets opened in its namespace); it returns what the VMM backend needs
  (``launch["network"]``: the namespace path, the tap's name, the guest's MAC) and what
  the launch record keeps (`record_fields`);
* **teardown** (`teardown`): the Instance taken from the egress process (its sockets
  closed, credentials nobody else references deleted), every object the names of the
  Instance say may exist, then the record; repeatable after a crash at any step;
* **a network switch** (`switch`): the egress process given the new policy's Egress or
  Resolver first (so the table never steers to a port nobody serves for it), the whole
  table replaced in one transaction, then the Instance taken from the egress process
  when the new policy names neither;
* **adoption** (`adopt`): the table read back, rewritten from the recorded policy or,
  in the four refusal cases, the network isolated.

Everything here blocks (netlink, libnftables, fsync): the async methods run it on a
worker thread, and `_lock` keeps one Instance's steps from overlapping on two threads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import trio

from kibotos.core import failpoints
from kibotos.core.errors import FailedPrecondition, KibotosError
from kibotos.guest import GuestAddress, GuestNetwork
from kibotos.network_config import NetworkSection
from kibotos.node.network import enforce, host_table, netns, plumbing
from kibotos.node.network.names import NETNS_DIR, TABLE, TABLE_FAMILY, NetworkNames
from kibotos.node.network.policy import (
    NetworkPolicy,
    needs_egress_process,
    parse_policy,
    to_record,
    why_no_egress_process,
    why_not_enforceable,
)
from kibotos.node.network.records import NetworkRecord, NetworkRecords
from kibotos.node.network.table_check import TableReport

T = TypeVar("T")

#: The first byte of every guest MAC: locally administered, unicast (each tap is an
#: Ethernet segment of its own, so the other five bytes need only be stable).
MAC_FIRST = 0x02


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


def guest_mac(instance_id: str) -> str:
    """The guest NIC's MAC, derived from the Instance ID alone (a relaunch, an adoption
    and the guest's configuration all agree without a record)."""
    digest = hashlib.sha256(f"kibotos-mac/{instance_id}".encode()).digest()
    return ":".join(f"{b:02x}" for b in (MAC_FIRST, *digest[:5]))


class EgressService(Protocol):
    """The node's egress processes as an Instance's network uses them.  It lives a
    layer above the Instances (`kibotos.node.egress.wiring`, started by the node's
    serve), so the lifecycle knows only this seam; None on a node that runs none.

    Both calls are idempotent, and both are repeated after a crash: the network records
    are the truth the service reloads at node start."""

    async def serve(self, record: NetworkRecord, policy: NetworkPolicy) -> None:
        """The egress process serves the Instance of `record` with `policy` (its Egress
        revision's credentials and its sockets) when this returns; raises (a
        `KibotosError` naming why) when it cannot, and then the guest's redirected
        connections are refused, never sent direct."""

    async def release(self, instance_id: str) -> None:
        """The egress process no longer serves the Instance (a no-op for one it does not
        serve)."""


@dataclasses.dataclass(frozen=True)
class Switched:
    """The result of `NetworkStep.switch`."""

    record: NetworkRecord
    changed: bool


class NetworkStep:
    """The network of a node's Instances (see the module docstring).

    `host_netns` is the namespace of the host ends (None: the node's own; tests pass
    one they made, ``[testing] network_host_netns``); `tap_owner` is ``(uid, gid)`` of
    the VMM account that opens the tap by name (either may be None: root only)."""

    def __init__(self, config: NetworkSection, *, scope: str, root: Path,
                 host_netns: Path | None = None, netns_dir: Path = NETNS_DIR,
                 tap_owner: tuple[int | None, int | None] = (None, None)) -> None:
        self.config = config
        self.scope = scope
        self.host_netns = host_netns
        self.netns_dir = netns_dir
        self.tap_owner = tap_owner
        self.records = NetworkRecords(root / "network")
        #: The egress processes (`EgressService`), set by the node's serve before any
        #: command arrives; None: a policy naming an Egress or Resolver is refused.
        self.egress: EgressService | None = None
        self._lock = threading.Lock()

    async def _run(self, fn: Callable[[], T]) -> T:
        def locked() -> T:
            with self._lock:
                return fn()

        return await trio.to_thread.run_sync(locked)

    # ------------------------------------------------------------------ node start

    async def prepare_host(self) -> None:
        """Forwarding on and the host table written (node start; connections kept)."""
        await self._run(lambda: host_table.prepare_host(self.config, self.scope,
                                                        host_netns=self.host_netns))

    def uplink(self) -> list[str]:
        return enforce.uplink_addresses(self.config, self.host_netns)

    # ------------------------------------------------------------------ admission

    def refusal(self, policy: NetworkPolicy) -> str | None:
        """Why this node cannot give an Instance `policy` (None: it can): its table
        cannot enforce it, or it names an Egress or a Resolver and no egress process
        serves this node's Instances (refused, never sent direct)."""
        return why_not_enforceable(to_record(policy), self.config) or \
            why_no_egress_process(policy, served=self.egress is not None)

    # ------------------------------------------------------------------ setup, teardown

    def names(self, instance_id: str) -> NetworkNames:
        """The Instance's names: its record's scope if it has one (the scope may have
        changed since), else this node's."""
        record = self.records.read(instance_id)
        return record.names if record is not None else NetworkNames.of(self.scope, instance_id)

    async def setup(self, instance_id: str, policy: NetworkPolicy, revision: int | None
                    ) -> NetworkRecord:
        """Make (or finish making) the Instance's network, its first table written."""
        def setup() -> NetworkRecord:
            uplink = self.uplink()
            record = self.records.allocate(instance_id, self.scope, self.config, policy,
                                           uplink, revision)
            uid, gid = self.tap_owner
            plumbing.setup(record, host_netns=self.host_netns, netns_dir=self.netns_dir,
                           tap_uid=uid, tap_gid=gid)
            return enforce.write_table(self.records, record, self.config, uplink,
                                       netns_dir=self.netns_dir)

        record = await self._run(setup)
        if needs_egress_process(policy):
            await self._egress().serve(record, policy)
            failpoints.hit("node.network.after-egress")
        return record

    def _egress(self) -> EgressService:
        if self.egress is None:  # admission refused it; a record of an older node left it
            raise FailedPrecondition("the policy names an Egress or a Resolver and this "
                                     "node runs no egress process",
                                     details={"reason": "network_policy"})
        return self.egress

    async def teardown(self, instance_id: str) -> list[str]:
        """Take the Instance from the egress process, remove whatever network objects
        of the Instance exist, then its record; what was removed (empty for an Instance
        that has none)."""
        if self.egress is not None:  # before its namespace goes: its sockets live there
            await self.egress.release(instance_id)
            failpoints.hit("node.network.after-egress-release")

        def teardown() -> list[str]:
            removed = plumbing.teardown(self.names(instance_id), host_netns=self.host_netns,
                                        netns_dir=self.netns_dir)
            self.records.remove(instance_id)
            return removed

        return await self._run(teardown)

    def launch_fields(self, record: NetworkRecord) -> dict[str, Any]:
        """``launch["network"]`` for the VMM backend (docs/vm.md, "Launch description")."""
        names = record.names
        return {"netns_path": str(names.netns_path(self.netns_dir)), "tap": names.tap,
                "mac": guest_mac(record.instance_id)}

    def record_fields(self, record: NetworkRecord) -> dict[str, Any]:
        """What the launch record keeps of the network (spec: the netns, tap, veth,
        addresses and table)."""
        names = record.names
        return {"netns": names.netns, "netns_path": str(names.netns_path(self.netns_dir)),
                "tap": names.tap, "host_veth": names.host_veth, "ns_veth": names.ns_veth,
                "mac": guest_mac(record.instance_id), "addresses": record.slot.to_record(),
                "table": f"{TABLE_FAMILY} {TABLE}",
                "record": str(self.records.path(record.instance_id))}

    def guest_network(self, instance_id: str) -> tuple[GuestNetwork, list[str]] | None:
        """The guest's interface and its resolvers (the launch configuration), or None
        when the Instance has no network record."""
        record = self.records.read(instance_id)
        if record is None:
            return None
        config = enforce.guest_interface_config(record)
        addresses = [GuestAddress(family=a["family"], address=a["address"],
                                  prefix=a["prefix"], gateway=a["gateway"])
                     for a in config["addresses"]]
        return GuestNetwork(mac=guest_mac(instance_id), addresses=addresses), \
            list(config["resolvers"])

    # ------------------------------------------------------------------ switch, adoption

    async def switch(self, instance_id: str, policy: NetworkPolicy, revision: int
                     ) -> Switched:
        """A network switch: refused for a revision older than the one in force (or
        the same revision with another policy); a repeat of the one in force changes
        nothing.  The caller holds the Instance's lock (one switch at a time)."""
        checked = await self._run(lambda: self._check_switch(instance_id, policy, revision))
        if isinstance(checked, Switched):
            return checked
        try:
            if needs_egress_process(policy):
                await self._egress().serve(checked, policy)
            done = await self._run(lambda: enforce.switch_policy(
                self.records, checked, policy, self.config, self.uplink(),
                netns_dir=self.netns_dir, revision=revision))
        except KibotosError:
            await self._egress_back(checked)
            raise
        if self.egress is not None and not needs_egress_process(policy):
            await self.egress.release(instance_id)
        return Switched(done, changed=True)

    async def _egress_back(self, record: NetworkRecord) -> None:
        """A switch that failed after the egress process got the new policy: it gets
        the policy still in force back (or lets the Instance go)."""
        if self.egress is None:
            return
        old = parse_policy(record.policy)
        if needs_egress_process(old):
            await self.egress.serve(record, old)
        else:
            await self.egress.release(record.instance_id)

    def _check_switch(self, instance_id: str, policy: NetworkPolicy, revision: int
                      ) -> NetworkRecord | Switched:
        """The record to switch, or the `Switched` answer of a repeat."""
        record = self.records.read(instance_id)
        if record is None:
            raise FailedPrecondition(f"Instance {instance_id} has no network on this "
                                     "node", details={"reason": "no_network"})
        wanted = to_record(policy)
        current = record.pending_revision if record.pending_policy is not None \
            else record.revision
        if current is not None and revision < current:
            raise FailedPrecondition(
                f"network revision {revision} of Instance {instance_id} is older than "
                f"revision {current}, which is in force", details={"reason": "stale"})
        if record.pending_policy is None and revision == current:
            if record.policy != wanted:
                raise FailedPrecondition(
                    f"network revision {revision} of Instance {instance_id} is in "
                    "force with another policy", details={"reason": "stale"})
            return Switched(record, changed=False)
        return record

    async def adopt(self, instance_id: str, vmm_pid: int | None) -> enforce.Adoption | None:
        """Node start, an Instance that runs on: its table rewritten from the recorded
        policy (finishing a half-done switch), or its network isolated in the spec's
        four refusal cases (`Adoption.report.refused`; the caller fails the Instance).
        None when the Instance has no network record."""
        def adopt() -> enforce.Adoption | None:
            record = self.records.read(instance_id)
            if record is None:
                return None
            vmm_netns = Path(f"/proc/{vmm_pid}/ns/net") if vmm_pid else None
            path = record.names.netns_path(self.netns_dir)
            if vmm_netns is not None and netns.is_netns(path) and \
                    _inode(vmm_netns) not in (None, _inode(path)):
                # the name was bound to another namespace since: its rules are not the
                # guest's; the VMM's own namespace is isolated
                enforce.isolate(record, path=vmm_netns)
                return enforce.Adoption(record, TableReport(
                    (f"the network namespace {path} is not the one the VMM runs in",), ()),
                    rewritten=False)
            return enforce.adopt(self.records, record, self.config, self.uplink(),
                                 netns_dir=self.netns_dir, vmm_netns=vmm_netns)

        return await self._run(adopt)
