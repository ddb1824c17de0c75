"""A Workspace's network policy in ctrl: what it needs of a node, what its node is sent,
and the store rules of a network switch (docs/network.md, "The policy in ctrl").

The policy is kept as the operator wrote it (``{public_egress, allow_out, deny_out,
egress, resolver}``, the Egress and Resolver by name) or NULL, the *deployment
default*.  The default means "the network the node provides": on a node with
``[network]`` the guest gets a network with public egress when that node provides it
(and only DNS when it does not), on a node without ``[network]`` no network at all, as
before networking existed.  So Workspaces created without a policy keep running on
nodes without ``[network]``, and placement ignores the network for them.  A policy
given explicitly is a promise: it is placed only on a node with ``[network]``, and
when it asks for public egress only on one that provides it.

What a node is sent is the protocol's `NetworkPolicy`, with the Egress and Resolver
*resolved*: their current revision and address (never a secret: the node fetches the
credentials of that revision itself).  A create, start or switch resolves the names
first and checks in its commit that they did not change meanwhile
(`check_unchanged`): an Egress updated or deleted while a node was being asked makes
the write `aborted`, to be retried, rather than recording a revision nobody keeps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from kibotos.core.errors import Aborted, FailedPrecondition, NotFound
from kibotos.ctrl.model import instances as inst_mod
from kibotos.ctrl.model import workspace_records as w
from kibotos.ctrl.model.nodes import record_event
from kibotos.ctrl.store.models import Egress, Instance, Resolver, Workspace
from kibotos.protocol import EgressRef, NetworkPolicy, ResolverRef


class NetworkNeed(StrEnum):
    """What a Workspace's policy needs of a node."""

    #: The deployment default: any node; it gets the network the node provides.
    ANY = "any"
    #: An explicit policy: a node with ``[network]``.
    NETWORK = "network"
    #: An explicit policy with public egress: a node that provides public egress.
    PUBLIC_EGRESS = "public_egress"


@dataclass(frozen=True)
class NodeNetwork:
    """A node's ``facts.network``: it has ``[network]``, with or without public egress."""

    public_egress: bool


def node_network(facts: Any) -> NodeNetwork | None:
    """The network a node reported in its hello or report; None: no network at all
    (no ``[network]``, or a node from before networking)."""
    raw = getattr(facts, "node_facts", None) or {}
    network = raw.get("network") if isinstance(raw, Mapping) else None
    if not isinstance(network, Mapping):
        return None
    return NodeNetwork(public_egress=network.get("public_egress") is True)


def need_of(policy: Mapping[str, Any] | None) -> NetworkNeed:
    if policy is None:
        return NetworkNeed.ANY
    return NetworkNeed.PUBLIC_EGRESS if policy.get("public_egress") else NetworkNeed.NETWORK


def refusal(need: NetworkNeed, network: NodeNetwork | None) -> str | None:
    """Why a node with `network` cannot take a Workspace that needs `need` (None: it
    can); placement's wording."""
    if need is NetworkNeed.ANY:
        return None
    if network is None:
        return "no network on the node ([network] absent), and the Workspace has a network policy"
    if need is NetworkNeed.PUBLIC_EGRESS and not network.public_egress:
        return "the node does not provide public egress, which the Workspace's policy needs"
    return None


# ------------------------------------------------------------------------ resolving


@dataclass(frozen=True)
class Resolved:
    """A policy with its Egress and Resolver looked up (see the module docstring)."""

    #: As stored (None: the deployment default).
    policy: dict[str, Any] | None
    #: What an explicit policy sends every node; None for the default.
    wire: NetworkPolicy | None = None

    @property
    def need(self) -> NetworkNeed:
        return need_of(self.policy)

    def for_node(self, network: NodeNetwork | None) -> NetworkPolicy | None:
        """``instance.create``'s ``network`` on a node with `network`."""
        if self.wire is not None:
            return self.wire
        if network is None:
            return None
        return NetworkPolicy(public_egress=network.public_egress)


def _egress_ref(row: Egress) -> EgressRef:
    return EgressRef(name=row.name, revision=row.revision, address=row.address,
                     authenticated=row.username is not None)


def resolve(session: Session, policy: Mapping[str, Any] | None) -> Resolved:
    """Look up the policy's Egress and Resolver: `NotFound` for a name that does not
    exist, `FailedPrecondition` for a Resolver that goes through an Egress the policy
    does not name."""
    if policy is None:
        return Resolved(None)
    stored = dict(policy)
    egress = resolver = None
    if stored.get("egress") is not None:
        row = session.get(Egress, stored["egress"])
        if row is None:
            raise NotFound(f"egress {stored['egress']} does not exist",
                           details={"egress": stored["egress"]})
        egress = _egress_ref(row)
    if stored.get("resolver") is not None:
        res = session.get(Resolver, stored["resolver"])
        if res is None:
            raise NotFound(f"resolver {stored['resolver']} does not exist",
                           details={"resolver": stored["resolver"]})
        if res.via_egress is not None and res.via_egress != stored.get("egress"):
            raise FailedPrecondition(
                f"resolver {res.name} goes through egress {res.via_egress}: the policy "
                f"must name that egress too (--egress {res.via_egress})",
                details={"resolver": res.name, "via_egress": res.via_egress})
        resolver = ResolverRef(name=res.name, revision=res.revision, upstream=res.upstream,
                               via_egress=res.via_egress is not None)
    wire = NetworkPolicy(public_egress=stored["public_egress"],
                         allow_out=list(stored["allow_out"]),
                         deny_out=list(stored["deny_out"]), egress=egress,
                         resolver=resolver)
    return Resolved(stored, wire)


def check_unchanged(session: Session, resolved: Resolved) -> None:
    """In the transaction that records what a node was sent: its Egress and Resolver
    still exist at the revisions sent (rows locked, so a delete waits for this)."""
    wire = resolved.wire
    if wire is None:
        return
    egress = None if wire.egress is None else session.get(
        Egress, wire.egress.name, with_for_update=True)
    resolver = None if wire.resolver is None else session.get(
        Resolver, wire.resolver.name, with_for_update=True)
    checks: list[tuple[str, EgressRef | ResolverRef | None, int | None]] = [
        ("egress", wire.egress, None if egress is None else egress.revision),
        ("resolver", wire.resolver, None if resolver is None else resolver.revision)]
    for kind, ref, revision in checks:
        if ref is None:
            continue
        if revision != ref.revision:
            now = "was deleted" if revision is None else f"is at revision {revision} now"
            raise Aborted(f"{kind} {ref.name} changed while the Workspace's node was asked "
                          f"(revision {ref.revision} was sent, it {now}): retry",
                          details={kind: ref.name})


def wire_json(policy: NetworkPolicy | None) -> dict[str, Any] | None:
    """The policy as an Instance row keeps it (every field, as sent)."""
    return None if policy is None else policy.model_dump(mode="json")


def store_on_workspace(ws: Workspace, policy: Mapping[str, Any] | None) -> None:
    ws.network_policy = None if policy is None else dict(policy)
    ws.network_egress = None if policy is None else policy.get("egress")
    ws.network_resolver = None if policy is None else policy.get("resolver")


def store_on_instance(inst: Instance, sent: NetworkPolicy | None, revision: int) -> None:
    inst.network = wire_json(sent)
    inst.network_revision = None if sent is None else revision


# ------------------------------------------------------------------------ switching


@dataclass(frozen=True)
class SwitchPlan:
    """A network switch as decided on the Workspace read before the node is asked."""

    workspace_id: str
    revision: int
    #: The revision the new policy gets (the current one + 1).
    network_revision: int
    resolved: Resolved
    #: The Instance the switch goes to (None: nothing runs; the policy is recorded).
    instance_id: str | None
    node_id: str | None
    #: Whether that Instance was started with a network at all.
    instance_has_network: bool


def switch_plan(session: Session, workspace_id: str, expected: int | None,
                policy: Mapping[str, Any] | None) -> SwitchPlan:
    """Check a Workspace can switch now: running (AVAILABLE, its Instance holding its
    resources) or not running at all (STOPPED, or FAILED holding nothing)."""
    ws = w.get_workspace(session, workspace_id)
    w.check_revision(ws, expected)
    holding = inst_mod.holds_allocation(session, ws.current_instance_id)
    details = {"workspace_id": workspace_id, "state": ws.state}
    if ws.state in (w.CREATING, w.STARTING, w.STOPPING):
        raise FailedPrecondition(f"workspace {workspace_id} is {ws.state}: set its network "
                                 "once it is AVAILABLE or STOPPED", details=details)
    if ws.state in (w.DELETING, w.DELETED):
        raise FailedPrecondition(f"workspace {workspace_id} is {ws.state}", details=details)
    if ws.state == w.FAILED and holding:
        raise FailedPrecondition(
            f"workspace {workspace_id} is FAILED and its Instance still holds its "
            f"resources on node {ws.node_id}: stop it with `kibo workspace stop "
            f"{workspace_id} --force` first", details=details)
    resolved = resolve(session, policy)
    instance_id = node_id = None
    has_network = False
    if ws.state == w.AVAILABLE and holding:
        inst = session.get(Instance, ws.current_instance_id)
        instance_id, node_id = ws.current_instance_id, ws.node_id
        has_network = inst is not None and inst.network is not None
    return SwitchPlan(workspace_id, ws.revision, ws.network_revision + 1, resolved,
                      instance_id, node_id, has_network)


def refresh_targets(session: Session, egress: str) -> list[str]:
    """The running Workspaces whose policy names Egress `egress` (a new revision of it
    goes to their nodes)."""
    query = (select(Workspace.workspace_id)
             .where(Workspace.network_egress == egress, Workspace.state == w.AVAILABLE)
             .order_by(Workspace.workspace_id))
    return list(session.scalars(query))


def refresh_plan(session: Session, workspace_id: str, egress: str) -> SwitchPlan | None:
    """A switch of a running Workspace to the current revision of its Egress, with its
    policy unchanged; None when it is not running with a network, no longer names
    `egress`, or its Instance has that revision already."""
    ws = session.get(Workspace, workspace_id)
    if ws is None or ws.state != w.AVAILABLE or ws.network_egress != egress \
            or ws.current_instance_id is None:
        return None
    inst = session.get(Instance, ws.current_instance_id)
    if inst is None or inst.network is None \
            or not inst_mod.holds_allocation(session, ws.current_instance_id):
        return None
    plan = switch_plan(session, workspace_id, None, ws.network_policy)
    wire = plan.resolved.wire
    sent = inst.network.get("egress") if isinstance(inst.network, dict) else None
    if wire is None or wire.egress is None or (
            isinstance(sent, dict) and sent.get("revision") == wire.egress.revision):
        return None
    return plan


def reserve_revision(session: Session, *, plan: SwitchPlan) -> None:
    """Count the switch's revision as used before the node is asked.  Should the
    node apply it and its answer be lost (a timeout, a session that ends, a ctrl that
    dies), the next switch takes a later revision, not this one again with another
    policy, which the node would refuse as stale for good."""
    ws = w.get_workspace(session, plan.workspace_id, for_update=True)
    ws.network_revision = max(ws.network_revision, plan.network_revision)


def release_revision(session: Session, *, plan: SwitchPlan) -> None:
    """The node answered with a refusal, so nothing was applied: the revision is the
    next switch's again (unless a later one was reserved meanwhile)."""
    ws = w.get_workspace(session, plan.workspace_id, for_update=True)
    if ws.network_revision == plan.network_revision:
        ws.network_revision = plan.network_revision - 1


def commit_switch(session: Session, *, plan: SwitchPlan, expected: int | None,
                  sent: NetworkPolicy | None, now: datetime,
                  cause: str = "set-network") -> dict[str, Any]:
    """Record the new policy (and, for a running Workspace, what its node now enforces),
    bump the Workspace's revision and note the change as an ``events`` row."""
    ws = w.get_workspace(session, plan.workspace_id, for_update=True)
    w.check_revision(ws, expected)
    if ws.revision != plan.revision or ws.current_instance_id != plan.instance_id:
        raise Aborted(f"workspace {plan.workspace_id} changed while its network was being "
                      "switched: read it again and retry",
                      details={"workspace_id": plan.workspace_id, "revision": ws.revision})
    check_unchanged(session, plan.resolved)
    store_on_workspace(ws, plan.resolved.policy)
    ws.network_revision = plan.network_revision
    ws.revision += 1
    ws.updated_at = now
    if plan.instance_id is not None:
        inst = session.get(Instance, plan.instance_id, with_for_update=True)
        if inst is not None:
            store_on_instance(inst, sent, plan.network_revision)
    record_event(session, now, plan.workspace_id, "network",
                 {"revision": plan.network_revision, "policy": plan.resolved.policy,
                  "instance_id": plan.instance_id, "node_id": plan.node_id, "cause": cause})
    last = ws.current_instance_id or ws.last_instance_id
    return w.workspace_json(ws, session.get(Instance, last) if last else None)
