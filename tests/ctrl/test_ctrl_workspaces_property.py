"""Properties of admission + ranking (hypothesis), against a reference written here
from the rules of docs/architecture.md ("Placement"), not from the code under test:

* no placement ever exceeds a node's schedulable CPU or memory;
* a placement never lands on a node the rules do not admit;
* ``--node`` is respected: the pinned node or a refusal, never another node;
* the incremental fast path (cached sort keys) picks exactly what the policy's full
  ``rank`` over the admitted nodes picks first, through node changes and releases.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kibotos.backends import NodeCapacity, PlacementRequest
from kibotos.ctrl.model import nodes, overcommit
from kibotos.ctrl.model.placement import CapacityIndex, Demand, IndexState
from kibotos.ctrl.store.changes import AllocationSnapshot, NodeSnapshot
from kibotos.plugins import load_plugins

GI = 1 << 30
T0 = datetime(2026, 1, 1, tzinfo=UTC)
REGISTRIES = load_plugins()


@dataclass
class NodeSpec:
    node_id: str
    cpu: int
    mem: int
    cpu_ratio: int
    mem_ratio: int
    admitted: bool = True
    drain: bool = False
    isolated: bool = False
    retired: bool = False
    alive: bool = True
    clock_measured: bool = True
    clock_offset_ms: float = 0.0
    memory_tight: bool = False
    confirmed: bool = True
    default_available: bool = True
    shared: bool = False
    used: dict[str, tuple[int, int]] = field(default_factory=dict)

    def snapshot(self) -> NodeSnapshot:
        node = nodes.new_node(self.node_id, T0)
        node.admission = "admitted" if self.admitted else "revoked"
        node.drain_requested = self.drain
        node.isolated_incarnation = 1 if self.isolated else None
        node.retired_at = T0 if self.retired else None
        node.incarnation = 2
        node.session_alive = self.alive
        node.session_started_at = T0
        node.clock_measured_at = T0 + timedelta(seconds=1) if self.clock_measured else None
        node.clock_offset_ms = self.clock_offset_ms
        node.clock_uncertainty_ms = 1.0
        node.memory_tight = self.memory_tight
        node.resources_cpu_millis = self.cpu
        node.resources_memory_bytes = self.mem
        node.overcommit_cpu = self.cpu_ratio
        node.overcommit_memory = self.mem_ratio
        node.overcommit_sent_serial = 3
        node.overcommit_confirmed_serial = 3 if self.confirmed else 2
        pools: list[dict[str, Any]] = [{"id": f"{self.node_id}-local", "default": True,
                                        "available": self.default_available}]
        if self.shared:
            pools.append({"id": "shared", "shared": True, "default": False})
        node.node_facts = {"pools": pools}
        return NodeSnapshot.of(node)

    # ---- the reference: the rules as docs/architecture.md states them
    def sched(self) -> tuple[int, int]:
        return self.cpu * self.cpu_ratio // 1000, self.mem * self.mem_ratio // 1000

    def used_total(self) -> tuple[int, int]:
        return (sum(c for c, _ in self.used.values()), sum(m for _, m in self.used.values()))

    def admits(self, cpu: int, mem: int, pools: frozenset[str] | None) -> bool:
        if (not self.admitted or self.drain or self.isolated or self.retired or not self.alive
                or not self.clock_measured or abs(self.clock_offset_ms) - 1.0 > 30_000
                or self.memory_tight or not self.confirmed):
            return False
        sched_cpu, sched_mem = self.sched()
        used_cpu, used_mem = self.used_total()
        if used_cpu + cpu > sched_cpu or used_mem + mem > sched_mem:
            return False
        if pools is None:
            return self.default_available
        return pools <= ({"shared"} if self.shared else set())


specs = st.builds(
    NodeSpec,
    node_id=st.just(""),
    cpu=st.sampled_from([1000, 2000, 4000, 16000]),
    mem=st.sampled_from([2 * GI, 8 * GI, 64 * GI]),
    cpu_ratio=st.sampled_from([0, 500, 1000, 2500]),
    mem_ratio=st.sampled_from([500, 1000, 1500]),
    admitted=st.sampled_from([True, True, True, False]),
    drain=st.sampled_from([False, False, False, True]),
    isolated=st.sampled_from([False, False, False, True]),
    retired=st.sampled_from([False, False, False, True]),
    alive=st.sampled_from([True, True, True, False]),
    clock_measured=st.sampled_from([True, True, True, False]),
    clock_offset_ms=st.sampled_from([0.0, 12.0, -29_000.0, 31_000.0, -45_000.0]),
    memory_tight=st.sampled_from([False, False, False, True]),
    confirmed=st.sampled_from([True, True, True, False]),
    default_available=st.sampled_from([True, True, True, False]),
    shared=st.booleans(),
)

steps = st.lists(st.tuples(
    st.sampled_from(["place", "place", "place", "pin", "release", "change"]),
    st.sampled_from([250, 500, 1000, 3000]),       # cpu millis
    st.sampled_from([GI // 4, GI, 3 * GI]),         # memory
    st.booleans(),                                   # shared pool (start) or create
    st.integers(0, 1000),                            # picks a node / an allocation
), min_size=1, max_size=40)


def capacities(spec_list: list[NodeSpec], cpu: int, mem: int,
               pools: frozenset[str] | None) -> list[NodeCapacity]:
    out = []
    for s in spec_list:
        if s.admits(cpu, mem, pools):
            used = s.used_total()
            out.append(NodeCapacity(s.node_id, *s.sched(), *used, len(s.used)))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(specs, min_size=1, max_size=8), steps,
       st.sampled_from(["binpack", "spread"]))
def test_admission_and_ranking(spec_list: list[NodeSpec], plan: list[tuple[Any, ...]],
                               policy_name: str) -> None:
    for i, spec in enumerate(spec_list):
        spec.node_id = f"node-{i}"
    policy = REGISTRIES.placement.get(policy_name)({})
    index = CapacityIndex(policy)
    index.install(IndexState(overcommit.DefaultRatios(),
                             [spec.snapshot() for spec in spec_list], []))
    by_id = {s.node_id: s for s in spec_list}
    counter = 0
    for action, cpu, mem, shared, pick in plan:
        pools = frozenset({"shared"}) if shared else None
        demand = Demand(cpu, mem, pools)
        if action == "release":
            held = [(s, i) for s in spec_list for i in s.used]
            if held:
                spec, instance_id = held[pick % len(held)]
                c, m = spec.used.pop(instance_id)
                index.apply([AllocationSnapshot(instance_id, spec.node_id, c, m, True)])
            continue
        if action == "change":
            spec = spec_list[pick % len(spec_list)]
            spec.memory_tight = not spec.memory_tight
            spec.drain = pick % 3 == 0
            index.apply([spec.snapshot()])
            continue
        if action == "pin":
            spec = spec_list[pick % len(spec_list)]
            refusal = index.verdict(spec.node_id, demand)
            assert (refusal is None) == spec.admits(cpu, mem, pools), (refusal, spec)
            chosen = spec.node_id if refusal is None else None
            if refusal is not None:
                sched_cpu, sched_mem = spec.sched()
                used_cpu, used_mem = spec.used_total()
                short = used_cpu + cpu > sched_cpu or used_mem + mem > sched_mem
                if refusal.code == "resource_exhausted":
                    assert short or spec.memory_tight
        else:
            chosen = index.best(demand)
            expected = capacities(spec_list, cpu, mem, pools)
            if not expected:
                assert chosen is None
                continue
            ranked = policy.rank(PlacementRequest(cpu, mem), expected)
            assert chosen == ranked[0], (chosen, ranked)
            # The full ranking is the same list of nodes.
            assert sorted(index.ranked(demand)) == sorted(c.node_id for c in expected)
        if chosen is None:
            continue
        spec = by_id[chosen]
        assert spec.admits(cpu, mem, pools)
        counter += 1
        instance_id = f"inst-{counter}"
        spec.used[instance_id] = (cpu, mem)
        index.reserve(chosen, instance_id, cpu, mem)
        if counter % 2:  # half of them commit: the Allocation replaces the reservation
            index.apply([AllocationSnapshot(instance_id, chosen, cpu, mem, False)])
        for s in spec_list:
            used_cpu, used_mem = s.used_total()
            sched_cpu, sched_mem = s.sched()
            assert (used_cpu, used_mem) == index.allocated(s.node_id)
            if used_cpu or used_mem:
                assert used_cpu <= sched_cpu
                assert used_mem <= sched_mem


capacities_st = st.builds(
    NodeCapacity, node_id=st.text("abc", min_size=1, max_size=4),
    schedulable_cpu_millis=st.integers(0, 1 << 20),
    schedulable_memory_bytes=st.integers(0, 1 << 45),
    allocated_cpu_millis=st.integers(0, 1 << 20),
    allocated_memory_bytes=st.integers(0, 1 << 45))
requests_st = st.builds(PlacementRequest, cpu_millis=st.integers(0, 1 << 16),
                        memory_bytes=st.integers(0, 1 << 40))


@given(requests_st, capacities_st, capacities_st)
def test_integer_share_key_orders_exactly_like_the_fraction(
        request_: PlacementRequest, a: NodeCapacity, b: NodeCapacity) -> None:
    fa: Fraction = a.free_share_after(request_)
    fb: Fraction = b.free_share_after(request_)
    ka, kb = a.free_share_key_after(request_), b.free_share_key_after(request_)
    assert (fa < fb) == (ka < kb)
    assert (fa == fb) == (ka == kb)
