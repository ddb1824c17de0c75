"""binpack and spread: rankings on hand-made cases, and properties over random ones."""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kibotos.backends import NodeCapacity, PlacementPolicy, PlacementRequest
from kibotos.core.errors import InvalidArgument
from kibotos.plugins import load_plugins

GI = 2**30


@pytest.fixture(scope="module")
def policies() -> dict[str, PlacementPolicy]:
    regs = load_plugins()
    return {name: regs.placement.get(name)({}) for name in ("binpack", "spread")}


def node(node_id, cpu, mem, used_cpu=0, used_mem=0, instances=0) -> NodeCapacity:
    return NodeCapacity(node_id, cpu, mem * GI, used_cpu, used_mem * GI, instances)


REQ = PlacementRequest(cpu_millis=1000, memory_bytes=1 * GI)


def test_policies_meet_the_protocol(policies):
    for policy in policies.values():
        assert isinstance(policy, PlacementPolicy)


def test_binpack_fills_the_fullest_node_first(policies):
    nodes = [
        node("empty", 8000, 16),
        node("half", 8000, 16, 4000, 8),
        node("nearly-full", 8000, 16, 6000, 12),
    ]
    assert policies["binpack"].rank(REQ, nodes) == ["nearly-full", "half", "empty"]


def test_spread_puts_the_request_on_the_emptiest_node(policies):
    nodes = [
        node("nearly-full", 8000, 16, 6000, 12),
        node("empty", 8000, 16),
        node("half", 8000, 16, 4000, 8),
    ]
    assert policies["spread"].rank(REQ, nodes) == ["empty", "half", "nearly-full"]


def test_shares_are_relative_to_each_node_size(policies):
    # Same free amounts, different sizes: the big node keeps the larger share free.
    nodes = [node("big", 64000, 128, 56000, 120), node("small", 8000, 16)]
    assert policies["binpack"].rank(REQ, nodes) == ["big", "small"]
    assert policies["spread"].rank(REQ, nodes) == ["small", "big"]


def test_cpu_and_memory_are_combined(policies):
    # cpu-tight: CPU almost gone, memory untouched; balanced: both half used.
    # After the request: cpu-tight (1/8 + 15/16)/2 = 17/32, balanced (3/8 + 7/16)/2 = 13/32.
    nodes = [node("cpu-tight", 8000, 16, 6000, 0), node("balanced", 8000, 16, 4000, 8)]
    assert policies["binpack"].rank(REQ, nodes) == ["balanced", "cpu-tight"]
    assert policies["spread"].rank(REQ, nodes) == ["cpu-tight", "balanced"]


def test_binpack_ties_go_to_the_lower_node_id(policies):
    nodes = [node("node-c", 8000, 16), node("node-a", 8000, 16), node("node-b", 8000, 16)]
    assert policies["binpack"].rank(REQ, nodes) == ["node-a", "node-b", "node-c"]


def test_spread_ties_go_to_fewer_instances_then_lower_node_id(policies):
    nodes = [
        node("node-a", 8000, 16, instances=3),
        node("node-c", 8000, 16, instances=1),
        node("node-b", 8000, 16, instances=1),
    ]
    assert policies["spread"].rank(REQ, nodes) == ["node-b", "node-c", "node-a"]


def test_no_candidates_rank_to_nothing(policies):
    for policy in policies.values():
        assert policy.rank(REQ, []) == []


@pytest.mark.parametrize("name", ["binpack", "spread"])
def test_options_are_refused(name):
    cls = load_plugins().placement.get(name)
    with pytest.raises(InvalidArgument, match=f"^placement policy {name}: unknown option "
                                              r"weight \(it takes none\)$"):
        cls({"weight": 2})


node_ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=8)
capacities = st.builds(
    NodeCapacity,
    node_id=node_ids,
    schedulable_cpu_millis=st.integers(0, 256_000),
    schedulable_memory_bytes=st.integers(0, 2**40),
    allocated_cpu_millis=st.integers(0, 256_000),
    allocated_memory_bytes=st.integers(0, 2**40),
    instance_count=st.integers(0, 500),
)
requests = st.builds(
    PlacementRequest,
    cpu_millis=st.integers(0, 64_000),
    memory_bytes=st.integers(0, 2**38),
)


@given(requests, st.lists(capacities, max_size=40, unique_by=lambda c: c.node_id),
       st.randoms(use_true_random=False))
def test_rankings_are_permutations_and_ignore_input_order(request_, candidates, rnd):
    regs = load_plugins()
    shuffled = list(candidates)
    rnd.shuffle(shuffled)
    for name in ("binpack", "spread"):
        policy = regs.placement.get(name)({})
        ranked = policy.rank(request_, candidates)
        assert sorted(ranked) == sorted(c.node_id for c in candidates)
        assert policy.rank(request_, shuffled) == ranked


@given(requests, st.lists(capacities, min_size=1, max_size=40))
def test_ranking_is_a_permutation_even_with_repeated_ids(request_, candidates):
    for policy in (load_plugins().placement.get(n)({}) for n in ("binpack", "spread")):
        assert sorted(policy.rank(request_, candidates)) == sorted(c.node_id for c in candidates)


@given(requests, st.lists(capacities, min_size=1, max_size=40, unique_by=lambda c: c.node_id))
def test_binpack_and_spread_order_by_free_share(request_, candidates):
    regs = load_plugins()
    by_id = {c.node_id: c for c in candidates}
    shares = {c.node_id: c.free_share_after(request_) for c in candidates}
    binpack = regs.placement.get("binpack")({}).rank(request_, candidates)
    spread = regs.placement.get("spread")({}).rank(request_, candidates)
    assert [shares[i] for i in binpack] == sorted(shares.values())
    assert [shares[i] for i in spread] == sorted(shares.values(), reverse=True)
    for a, b in itertools.pairwise(spread):
        if shares[a] == shares[b]:
            assert (by_id[a].instance_count, a) < (by_id[b].instance_count, b)
    for a, b in itertools.pairwise(binpack):
        if shares[a] == shares[b]:
            assert a < b


def test_free_share_after_is_exact():
    n = node("n", 3000, 3, 1000, 1)
    # CPU (3000-1000-1000)/3000 = 1/3, memory (3-1-1)/3 = 1/3.
    assert n.free_share_after(REQ) == Fraction(1, 3)
    empty = NodeCapacity("z", 0, 0, 0, 0)
    assert empty.free_share_after(PlacementRequest(0, 0)) == 0


def test_ranking_a_large_cluster(policies):
    rnd = random.Random(7)
    nodes = [
        node(f"node-{i:04d}", 16000, 64, rnd.randrange(0, 15000), rnd.randrange(0, 63))
        for i in range(1000)
    ]
    shares = {n.node_id: n.free_share_after(REQ) for n in nodes}
    binpack = policies["binpack"].rank(REQ, nodes)
    spread = policies["spread"].rank(REQ, nodes)
    assert len(binpack) == len(spread) == 1000
    assert shares[binpack[0]] == min(shares.values())
    assert shares[spread[0]] == max(shares.values())
