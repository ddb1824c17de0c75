"""The cluster gauges of ctrl's ``/metrics``, computed when Prometheus scrapes.

Two sources, both cheap per scrape whatever the cluster's size:

* ctrl's in-memory placement index (`kibotos.ctrl.model.placement.CapacityIndex`, kept equal
  to the store by `StoreWatch`): nodes by status, per-node admission and capacity,
  pool membership and availability, and the live sessions of `SessionHub`.  No SQL.
* one store read (`read_store`) of aggregates that return a bounded number of rows:
  Workspaces by state (not DELETED: an index range on ``state``), the current
  Instances by state (those of Workspaces that execute, through the
  ``current_instance_id`` index), each pool's capacity and reservations (the three
  grouped queries a create runs anyway) and the command journal's size.  It is
  cached for ``[metrics] refresh_interval`` (10 s), so back-to-back scrapes, or
  several Prometheus servers, cost one read.  A failed read keeps the previous
  values and counts ``kibotos_ctrl_metrics_store_read_failures_total``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from kibotos.core.errors import KibotosError
from kibotos.ctrl.model import nodes
from kibotos.ctrl.model import workspace_records as w
from kibotos.ctrl.model.placement import CapacityIndex, pools_of
from kibotos.ctrl.pools import capacity as pool_capacity
from kibotos.ctrl.store.models import Command, Instance, StoragePool, Workspace

if TYPE_CHECKING:
    from kibotos.ctrl.live.context import CtrlContext

log = logging.getLogger("kibotos.ctrl.api.metrics")

NODE_STATUSES = ("READY", "OFFLINE", "DRAINING", "DRAINED", "ISOLATED", "REVOKED", "RETIRED")
WORKSPACE_STATES = (w.CREATING, w.STARTING, w.AVAILABLE, w.STOPPING, w.STOPPED, w.FAILED,
                    w.DELETING)
INSTANCE_STATES = ("CREATING", "RUNNING", "STOPPING", "STOPPED", "FAILED", "DESTROYED")


@dataclass
class StoreCounts:
    """What `read_store` found; `at` is trio time of the read (None: never read)."""

    workspaces: dict[str, int] = field(default_factory=dict)
    instances: dict[str, int] = field(default_factory=dict)
    pools: dict[str, tuple[int | None, int, bool]] = field(default_factory=dict)
    journal_entries: int = 0
    at: float | None = None


def read_store(session: Session) -> StoreCounts:
    """The bounded aggregates of the module docstring, in one transaction."""
    workspaces = {str(s): int(n) for s, n in session.execute(
        select(Workspace.state, func.count()).where(Workspace.state.in_(WORKSPACE_STATES))
        .group_by(Workspace.state))}
    instances = {str(s): int(n) for s, n in session.execute(
        select(Instance.state, func.count())
        .join(Workspace, Workspace.current_instance_id == Instance.instance_id)
        .where(Workspace.current_instance_id.is_not(None))
        .group_by(Instance.state))}
    lost = set(session.scalars(select(StoragePool.pool_id)
                               .where(StoragePool.lost_at.is_not(None))))
    pools = {pool_id: (room.capacity_bytes, room.reserved_bytes, pool_id in lost)
             for pool_id, room in pool_capacity.snapshot(session).items()}
    journal = int(session.scalar(select(func.count()).select_from(Command)) or 0)
    return StoreCounts(workspaces, instances, pools, journal)


class StoreGauges:
    """The cached `read_store` result; `refresh` reads again once it is old enough."""

    def __init__(self, ctx: CtrlContext) -> None:
        self.ctx = ctx
        self.counts = StoreCounts()
        self._lock = trio.Lock()

    async def refresh(self) -> None:
        interval = self.ctx.config.metrics.refresh_interval
        async with self._lock:  # concurrent scrapes wait for one read
            at = self.counts.at
            if at is not None and trio.current_time() - at < interval:
                return
            try:
                counts = await self.ctx.store.run(read_store)
            except KibotosError as exc:
                log.warning("metrics: store read failed, serving the previous values: %s",
                            exc.message)
                self.ctx.metrics.store_read_failures.inc()
                return
            counts.at = trio.current_time()
            self.counts = counts


class ClusterCollector(Collector):
    """Yields the gauges at scrape time (registered in the ctrl's own registry)."""

    def __init__(self, ctx: CtrlContext, store_gauges: StoreGauges,
                 index: CapacityIndex) -> None:
        self.ctx = ctx
        self.store_gauges = store_gauges
        self.index = index

    def describe(self) -> list[Any]:
        return []  # computed at scrape time: nothing to check at registration

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from self._from_index()
        yield from self._from_store()

    def _from_index(self) -> Iterator[GaugeMetricFamily]:
        live = getattr(self.ctx.sessions, "live", None)
        sessions = GaugeMetricFamily("kibotos_ctrl_node_sessions_live",
                                     "Node control sessions open on this ctrl")
        sessions.add_metric([], len(live()) if callable(live) else 0)
        yield sessions
        by_status = dict.fromkeys(NODE_STATUSES, 0)
        status = GaugeMetricFamily("kibotos_ctrl_node_status", "1 for each node that is "
                                   "not retired, labelled with its status",
                                   labels=["node_id", "status"])
        placeable = GaugeMetricFamily("kibotos_ctrl_node_placeable", "1 when placement may "
                                      "put new Instances on the node", labels=["node_id"])
        capacity = {
            name: GaugeMetricFamily(f"kibotos_ctrl_node_{name}", text, labels=["node_id"])
            for name, text in (
                ("schedulable_cpu_millis", "Reported CPU × overcommit ratio"),
                ("allocated_cpu_millis", "CPU of the unreleased Allocations on the node"),
                ("schedulable_memory_bytes", "Reported memory × overcommit ratio"),
                ("allocated_memory_bytes", "Memory of the unreleased Allocations"),
            )}
        members: dict[str, int] = {}
        available: dict[str, int] = {}
        for entry in sorted(self.index.nodes.values(), key=lambda e: e.node_id):
            facts = entry.facts
            state = nodes.status(facts)
            by_status[state] = by_status.get(state, 0) + 1
            if state == "RETIRED":
                continue  # retired nodes stay in the table forever: counted, not listed
            status.add_metric([entry.node_id, state], 1)
            placeable.add_metric([entry.node_id], 1 if entry.admitted else 0)
            for name, value in (("schedulable_cpu_millis", entry.sched_cpu),
                                ("allocated_cpu_millis", entry.alloc_cpu),
                                ("schedulable_memory_bytes", entry.sched_mem),
                                ("allocated_memory_bytes", entry.alloc_mem)):
                capacity[name].add_metric([entry.node_id], value)
            if facts.admission != "admitted":
                continue  # as kibo storage-pool shows: revoked nodes are no members
            for pool in pools_of(facts).values():
                members[pool.pool_id] = members.get(pool.pool_id, 0) + 1
                up = (pool.available and facts.session_alive
                      and facts.isolated_incarnation is None)
                available[pool.pool_id] = available.get(pool.pool_id, 0) + (1 if up else 0)
        count = GaugeMetricFamily("kibotos_ctrl_nodes", "Nodes by status",
                                  labels=["status"])
        for state, n in by_status.items():
            count.add_metric([state], n)
        yield count
        yield status
        yield placeable
        yield from capacity.values()
        member_g = GaugeMetricFamily("kibotos_ctrl_pool_members", "Nodes (not retired, "
                                     "not revoked) that declare the pool", labels=["pool_id"])
        avail_g = GaugeMetricFamily("kibotos_ctrl_pool_available_members",
                                    "Members with a live session that report the pool "
                                    "available", labels=["pool_id"])
        for pool_id in sorted(members):
            member_g.add_metric([pool_id], members[pool_id])
            avail_g.add_metric([pool_id], available[pool_id])
        yield member_g
        yield avail_g

    def _from_store(self) -> Iterator[GaugeMetricFamily]:
        counts = self.store_gauges.counts
        if counts.at is None:
            return
        ws = GaugeMetricFamily("kibotos_ctrl_workspaces", "Workspaces by state (DELETED "
                               "ones are not counted)", labels=["state"])
        for state in WORKSPACE_STATES:
            ws.add_metric([state], counts.workspaces.get(state, 0))
        yield ws
        inst = GaugeMetricFamily("kibotos_ctrl_instances", "Current Instances (those "
                                 "holding an Allocation) by the state nodes reported",
                                 labels=["state"])
        for state in sorted(set(INSTANCE_STATES) | set(counts.instances)):
            inst.add_metric([state], counts.instances.get(state, 0))
        yield inst
        cap = GaugeMetricFamily("kibotos_ctrl_pool_capacity_bytes", "The pool's capacity "
                                "as set by the operator (absent: not set)", labels=["pool_id"])
        res = GaugeMetricFamily("kibotos_ctrl_pool_reserved_bytes", "Capacity reserved by "
                                "the objects in the pool", labels=["pool_id"])
        lost = GaugeMetricFamily("kibotos_ctrl_pool_lost", "1 when the pool was declared "
                                 "lost", labels=["pool_id"])
        for pool_id, (capacity, reserved, is_lost) in sorted(counts.pools.items()):
            if capacity is not None:
                cap.add_metric([pool_id], capacity)
            res.add_metric([pool_id], reserved)
            lost.add_metric([pool_id], 1 if is_lost else 0)
        yield cap
        yield res
        yield lost
        journal = GaugeMetricFamily("kibotos_ctrl_command_journal_entries",
                                    "Entries in the command journal")
        journal.add_metric([], counts.journal_entries)
        yield journal
        age = GaugeMetricFamily("kibotos_ctrl_metrics_store_read_age_seconds",
                                "Age of the store read behind the store-derived gauges")
        age.add_metric([], max(trio.current_time() - counts.at, 0.0))
        yield age


def install(ctx: CtrlContext, index: CapacityIndex, operator_check: Any) -> Any:
    """Wire the gauges and the store timing into ``ctx.metrics`` (once per context,
    however many apps are built on it) and return the ``GET /metrics`` endpoint.
    `index` is the live services' capacity index (`Runtime.index`); `operator_check`
    is `Authenticator.operator`, used when ``[metrics] require_auth`` is set."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.requests import Request
    from starlette.responses import Response

    metrics = ctx.metrics
    gauges: StoreGauges | None = getattr(metrics, "store_gauges", None)
    if gauges is None:
        gauges = StoreGauges(ctx)
        metrics.store_gauges = gauges
        metrics.registry.register(ClusterCollector(ctx, gauges, index))
        metrics.watch_store(ctx.store.listen)
    store_gauges = gauges

    async def metrics_endpoint(request: Request) -> Response:
        if ctx.config.metrics.require_auth:
            await operator_check(request.headers.get("authorization"))
        await store_gauges.refresh()
        return Response(generate_latest(metrics.registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})

    return metrics_endpoint
