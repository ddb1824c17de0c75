"""Placement: one admission function, then the configured policy plugin ranks.

Admission (`admit`) is the same wherever a placement happens (create, start, move,
``--node``): `nodes.placeable` (admitted, not drained, not isolated, not retired,
session alive, clock within 30 s, memory not tight, overcommit confirmed), enough free
schedulable CPU and memory (reported × ratio − the unreleased Allocations ctrl holds
there), a network when the Workspace's policy needs one (public egress when it asks
for it; `network_policy.refusal`), and every pool that holds the Workspace's objects
reported available by the node (for a create: its default pool).  The policy plugin
then ranks the survivors; it never decides admission (docs/architecture.md, "Placement").

`CapacityIndex` keeps what admission needs in memory: each node's facts as last
committed and the Allocations on it, fed by `kibotos.ctrl.live.store_watch` so it changes
exactly when the store does.  In-flight placements *reserve* their amount until their
Allocation commits, so two concurrent creates never both take the last free core.

A policy with ``sort_key`` (`kibotos.backends.KeyedPlacementPolicy`) ranks by a key of
each node alone, so for a create's request shape (CPU, memory, labels) the index keeps
the key of every admitted node that can hold it and recomputes only the keys of nodes
that change; the best node is then a ``min`` over cached keys instead of a ranking of
every node per placement.  Other policies, and starts bound to the pools of existing
objects, rank the admitted nodes through ``rank`` each time.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from sqlalchemy import select
from sqlalchemy.orm import Session

from kibotos.backends import (
    KeyedPlacementPolicy,
    NodeCapacity,
    PlacementPolicy,
    PlacementRequest,
)
from kibotos.core.errors import FailedPrecondition, KibotosError, NotFound, ResourceExhausted
from kibotos.ctrl.model import nodes, overcommit
from kibotos.ctrl.model.network_policy import NetworkNeed, NodeNetwork, node_network, refusal
from kibotos.ctrl.model.nodes import NodeFacts
from kibotos.ctrl.store.changes import (
    AllocationSnapshot,
    Change,
    NodeSnapshot,
    SettingSnapshot,
)
from kibotos.ctrl.store.models import Allocation, Node

log = logging.getLogger("kibotos.ctrl.model.placement")

SHAPE_CACHE_SIZE = 16
#: `nodes.placeable`'s reason for a node whose host memory is tight.
MEMORY_TIGHT = "host memory tight"


@dataclass(frozen=True)
class Demand:
    """What one placement needs.  `pools` None is a create: the node's default pool
    (plus `extra_pools`, those of the Volumes it attaches); otherwise every pool that
    holds the Workspace's objects."""

    cpu_millis: int
    memory_bytes: int
    pools: frozenset[str] | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    extra_pools: frozenset[str] = frozenset()
    #: What its network policy needs of the node (`network_policy.NetworkNeed`).
    network: NetworkNeed = NetworkNeed.ANY

    def request(self) -> PlacementRequest:
        return PlacementRequest(self.cpu_millis, self.memory_bytes, dict(self.labels))

    def shape(self) -> tuple[int, int, frozenset[tuple[str, str]], NetworkNeed]:
        return (self.cpu_millis, self.memory_bytes, frozenset(self.labels.items()),
                self.network)


@dataclass(frozen=True)
class Refusal:
    """Why admission refused a node: ``failed_precondition``, or ``resource_exhausted``
    when the node lacks free capacity."""

    code: str
    reason: str

    def error(self, node_id: str) -> KibotosError:
        cls = ResourceExhausted if self.code == "resource_exhausted" else FailedPrecondition
        return cls(f"node {node_id} cannot take this Workspace: {self.reason}",
                   details={"node_id": node_id, "reason": self.reason})


@dataclass(frozen=True)
class PoolFact:
    pool_id: str
    shared: bool
    default: bool
    available: bool
    reason: str | None = None


def pools_of(facts: NodeFacts) -> dict[str, PoolFact]:
    """The pools a node reported in ``hello.facts.pools``; a pool without an
    ``available`` flag counts as available (the storage issue adds the flag)."""
    raw = getattr(facts, "node_facts", None) or {}
    out: dict[str, PoolFact] = {}
    for item in raw.get("pools") or () if isinstance(raw, dict) else ():
        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
            continue
        reason = item.get("reason")
        out[item["id"]] = PoolFact(item["id"], bool(item.get("shared", False)),
                                   bool(item.get("default", False)),
                                   bool(item.get("available", True)),
                                   reason if isinstance(reason, str) else None)
    return out


def default_pool(pools: Mapping[str, PoolFact]) -> PoolFact | None:
    """The pool a create puts new objects in: the one marked default, or the only one."""
    marked = [p for p in pools.values() if p.default]
    if len(marked) == 1:
        return marked[0]
    return next(iter(pools.values())) if len(pools) == 1 else None


@dataclass(frozen=True)
class IndexState:
    default: overcommit.DefaultRatios
    facts: list[NodeFacts]
    allocations: list[tuple[str, str, int, int]]


class NodeEntry:
    """One node as placement sees it; `version` grows with every change."""

    __slots__ = ("admitted", "alloc_cpu", "alloc_mem", "count", "default_pool", "facts",
                 "network", "node_id", "pools", "reason", "sched_cpu", "sched_mem",
                 "tight_hint", "version")

    def __init__(self, facts: NodeFacts) -> None:
        self.node_id = facts.node_id
        self.facts = facts
        self.admitted = False
        self.reason: str | None = None
        self.sched_cpu = self.sched_mem = self.alloc_cpu = self.alloc_mem = self.count = 0
        self.pools: dict[str, PoolFact] = {}
        self.default_pool: PoolFact | None = None
        #: ``facts.network``: None when the node gives Instances no network.
        self.network: NodeNetwork | None = None
        self.tight_hint = False
        self.version = 0

    def capacity(self) -> NodeCapacity:
        return NodeCapacity(self.node_id, self.sched_cpu, self.sched_mem, self.alloc_cpu,
                            self.alloc_mem, self.count)


def admit(entry: NodeEntry, demand: Demand) -> Refusal | None:
    """The one admission function; None when the node may take `demand`."""
    if not entry.admitted:
        # Memory tight is a shortage, like capacity: "if no node can take them, the
        # request returns resource_exhausted" (spec/nodes.txt, overcommit).
        code = ("resource_exhausted" if entry.reason == MEMORY_TIGHT
                else "failed_precondition")
        return Refusal(code, entry.reason or "not placeable")
    if entry.tight_hint:
        return Refusal("resource_exhausted",
                       f"{MEMORY_TIGHT} (the node refused a create for it)")
    free_cpu = entry.sched_cpu - entry.alloc_cpu
    if demand.cpu_millis > free_cpu:
        return Refusal("resource_exhausted",
                       f"not enough free CPU ({max(free_cpu, 0)} of {entry.sched_cpu} "
                       f"schedulable millicores free, {demand.cpu_millis} needed)")
    free_mem = entry.sched_mem - entry.alloc_mem
    if demand.memory_bytes > free_mem:
        return Refusal("resource_exhausted",
                       f"not enough free memory ({max(free_mem, 0)} of {entry.sched_mem} "
                       f"schedulable bytes free, {demand.memory_bytes} needed)")
    network = refusal(demand.network, entry.network)
    if network is not None:
        return Refusal("failed_precondition", network)
    if demand.pools is None:
        pool = entry.default_pool
        if pool is None:
            return Refusal("failed_precondition", "the node reports no default storage pool")
        if not pool.available:
            return Refusal("failed_precondition",
                           f"its default pool {pool.pool_id} is not available"
                           + (f": {pool.reason}" if pool.reason else ""))
    for pool_id in sorted(demand.extra_pools if demand.pools is None else demand.pools):
        fact = entry.pools.get(pool_id)
        if fact is None:
            return Refusal("failed_precondition", f"not attached to pool {pool_id}")
        if not fact.available:
            return Refusal("failed_precondition", f"pool {pool_id} is not available"
                           + (f": {fact.reason}" if fact.reason else ""))
    return None


class CapacityIndex:
    """Nodes, Allocations and reservations in memory, kept equal to the store by the
    `StoreWatch` feed (`apply`); see the module docstring."""

    def __init__(self, policy: PlacementPolicy, *,
                 shape_cache_size: int = SHAPE_CACHE_SIZE) -> None:
        self.policy = policy
        self._sort_key = policy.sort_key if isinstance(policy, KeyedPlacementPolicy) else None
        self.nodes: dict[str, NodeEntry] = {}
        #: node → instance → (cpu, memory): committed unreleased Allocations and
        #: reservations of placements in flight.
        self._held: dict[str, dict[str, tuple[int, int]]] = {}
        self._where: dict[str, str] = {}
        self._reserved: set[str] = set()
        self._default = overcommit.DefaultRatios()
        self._shapes: OrderedDict[Any, dict[str, Any]] = OrderedDict()
        self._shape_cache_size = shape_cache_size

    # ------------------------------------------------------------------ feeding

    @staticmethod
    def read(session: Session) -> IndexState:
        """Every node and unreleased Allocation, as committed (a worker thread reads;
        `install` puts it in place in the trio thread)."""
        default = overcommit.get_default(session)
        facts = [cast(NodeFacts, NodeSnapshot(dict(row._mapping)))
                 for row in session.execute(select(*Node.__table__.columns))]
        allocs = [(str(i), str(n), int(c), int(m)) for i, n, c, m in session.execute(
            select(Allocation.instance_id, Allocation.node_id, Allocation.cpu_millis,
                   Allocation.memory_bytes).where(Allocation.released_at.is_(None)))]
        return IndexState(default, facts, allocs)

    def install(self, state: IndexState) -> None:
        """Replace the contents with `state`, keeping the reservations in flight."""
        reserved = {i: (self._where[i], *self._held[self._where[i]][i])
                    for i in self._reserved if i in self._where}
        self._default = state.default
        self.nodes = {f.node_id: NodeEntry(f) for f in state.facts}
        self._held, self._where, self._reserved = {}, {}, set()
        for instance_id, node_id, cpu, mem in state.allocations:
            self._hold(node_id, instance_id, cpu, mem)
        for instance_id, (node_id, cpu, mem) in reserved.items():
            if instance_id not in self._where:
                self._hold(node_id, instance_id, cpu, mem)
                self._reserved.add(instance_id)
        self._shapes.clear()
        for node_id in self.nodes:
            self._recompute(node_id)

    def load(self, session: Session) -> None:
        """`read` and `install` in one go (tests and tools that own the index)."""
        self.install(self.read(session))

    def apply(self, changes: Iterable[Change]) -> None:
        """The `StoreWatch` subscriber: committed rows, applied in order."""
        touched: set[str] = set()
        for change in changes:
            if isinstance(change, NodeSnapshot):
                entry = self.nodes.get(change.node_id)
                facts = cast(NodeFacts, change)
                if entry is None:
                    self.nodes[change.node_id] = NodeEntry(facts)
                else:
                    entry.facts = facts
                    entry.tight_hint = False  # a fresh report supersedes the hint
                touched.add(change.node_id)
            elif isinstance(change, AllocationSnapshot):
                old = self._where.get(change.instance_id)
                if old is not None:
                    self._release(change.instance_id)
                    touched.add(old)
                if not change.released:
                    self._hold(change.node_id, change.instance_id, change.cpu_millis,
                               change.memory_bytes)
                    touched.add(change.node_id)
            elif isinstance(change, SettingSnapshot) and change.key == overcommit.DEFAULT_KEY:
                self._default = overcommit.DefaultRatios(
                    int(change.value["cpu"]), int(change.value["memory"]), change.version)
                touched.update(self.nodes)
        for node_id in touched:
            if node_id in self.nodes:
                self._recompute(node_id)

    def reserve(self, node_id: str, instance_id: str, cpu_millis: int,
                memory_bytes: int) -> None:
        """Hold capacity for a placement in flight until its Allocation commits (which
        replaces the reservation) or `unreserve`."""
        self._hold(node_id, instance_id, cpu_millis, memory_bytes)
        self._reserved.add(instance_id)
        self._recompute(node_id)

    def unreserve(self, instance_id: str) -> None:
        if instance_id not in self._reserved:
            return
        node_id = self._where.get(instance_id)
        self._release(instance_id)
        if node_id is not None and node_id in self.nodes:
            self._recompute(node_id)

    def mark_tight(self, node_id: str) -> None:
        """The node refused a create because its memory is tight: skip it until its
        next committed change (the report saying so, or saying it cleared)."""
        entry = self.nodes.get(node_id)
        if entry is not None:
            entry.tight_hint = True
            self._recompute(node_id)

    def _hold(self, node_id: str, instance_id: str, cpu: int, mem: int) -> None:
        self._held.setdefault(node_id, {})[instance_id] = (cpu, mem)
        self._where[instance_id] = node_id

    def _release(self, instance_id: str) -> None:
        node_id = self._where.pop(instance_id, None)
        self._reserved.discard(instance_id)
        if node_id is not None:
            self._held.get(node_id, {}).pop(instance_id, None)

    def _recompute(self, node_id: str) -> None:
        entry = self.nodes[node_id]
        facts = entry.facts
        entry.admitted, entry.reason = nodes.placeable(facts)
        entry.sched_cpu, entry.sched_mem = overcommit.schedulable(facts, self._default)
        held = self._held.get(node_id, {})
        entry.alloc_cpu = sum(c for c, _ in held.values())
        entry.alloc_mem = sum(m for _, m in held.values())
        entry.count = len(held)
        entry.pools = pools_of(facts)
        entry.default_pool = default_pool(entry.pools)
        entry.network = node_network(facts)
        entry.version += 1
        for shape, cache in self._shapes.items():
            key = self._key(entry, shape)
            if key is None:
                cache.pop(node_id, None)
            else:
                cache[node_id] = key

    # ------------------------------------------------------------------ reading

    def allocated(self, node_id: str) -> tuple[int, int]:
        entry = self.nodes[node_id]
        return entry.alloc_cpu, entry.alloc_mem

    def verdict(self, node_id: str, demand: Demand) -> Refusal | None:
        """Admission of one named node (``--node``); `NotFound` for an unknown node."""
        entry = self.nodes.get(node_id)
        if entry is None:
            raise NotFound(f"node {node_id} does not exist", details={"node_id": node_id})
        return admit(entry, demand)

    def candidates(self, demand: Demand, exclude: Collection[str] = ()) -> list[NodeEntry]:
        return [e for e in self.nodes.values()
                if e.node_id not in exclude and admit(e, demand) is None]

    def best(self, demand: Demand, exclude: Collection[str] = ()) -> str | None:
        """The best admitted node for `demand` that is not in `exclude`, or None."""
        if self._sort_key is not None and demand.pools is None and not demand.extra_pools:
            cache = self._shape_cache(demand)
            if not exclude:
                return str(min(cache.values())[-1]) if cache else None
            best: Any = None
            for value in cache.values():
                if value[-1] not in exclude and (best is None or value < best):
                    best = value
            return None if best is None else str(best[-1])
        ranked = self.ranked(demand, exclude)
        return ranked[0] if ranked else None

    def ranked(self, demand: Demand, exclude: Collection[str] = ()) -> list[str]:
        """Every admitted node, best first, as the policy's ``rank`` orders them."""
        cands = [e.capacity() for e in self.candidates(demand, exclude)]
        return rank(self.policy, demand.request(), cands)

    # ------------------------------------------------------------------ shape caches

    def _key(self, entry: NodeEntry, shape: Any) -> Any:
        cpu, mem, labels, network = shape
        demand = Demand(cpu, mem, None, dict(labels), network=network)
        if admit(entry, demand) is not None:
            return None
        assert self._sort_key is not None
        return (self._sort_key(demand.request(), entry.capacity()), entry.node_id)

    def _shape_cache(self, demand: Demand) -> dict[str, Any]:
        shape = demand.shape()
        cache = self._shapes.get(shape)
        if cache is not None:
            self._shapes.move_to_end(shape)
            return cache
        cache = {}
        for entry in self.nodes.values():
            key = self._key(entry, shape)
            if key is not None:
                cache[entry.node_id] = key
        self._shapes[shape] = cache
        while len(self._shapes) > self._shape_cache_size:
            self._shapes.popitem(last=False)
        return cache


def rank(policy: PlacementPolicy, request: PlacementRequest,
         candidates: list[NodeCapacity]) -> list[str]:
    """The policy's ranking, checked: a result that is not a permutation of the
    candidates (or an exception) falls back to the input order, and says so."""
    ids = [c.node_id for c in candidates]
    try:
        ranked = list(policy.rank(request, candidates))
    except Exception:
        log.exception("placement policy %s failed; using node order", policy.name)
        return ids
    if sorted(ranked) != sorted(ids):
        log.error("placement policy %s returned %r, not a permutation of the candidates; "
                  "using node order", policy.name, ranked[:10])
        return ids
    return ranked
