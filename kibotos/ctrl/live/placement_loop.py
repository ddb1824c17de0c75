"""The placement loop of creates and starts: candidates best first, each asked to
accept the Instance, the first acceptance recorded (docs/architecture.md, "Placement").

The capacity is reserved in the index before the node is asked, and given back if the
Instance is not recorded (refused, or the record went stale, or a replay won); an
Instance a node may have accepted but that is not recorded is destroyed.  Refusals that
say "not now, not here" (memory tight, drained, any failed_precondition or
resource_exhausted, a lost or silent session) move on to the next candidate; with
``--node`` there is none, and the node's refusal is the answer.

The loop works on the shared `Runtime` (index, in-flight map, sessions, metrics) and
tells its two followers through callbacks: ``created`` once an Instance is recorded
(the node feed then skips the node's repeated CREATING), ``orphaned`` for an Instance a
node may hold unrecorded (the Workspace tasks destroy it).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from sqlalchemy.orm import Session

from kibotos.core import ids
from kibotos.core.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    KibotosError,
    ResourceExhausted,
    Unavailable,
)
from kibotos.core.units import format_bytes, format_cores
from kibotos.ctrl.live.runtime import Runtime
from kibotos.ctrl.model import workspace_txns as tx
from kibotos.ctrl.model.placement import CapacityIndex, Demand, NodeEntry, admit
from kibotos.protocol import CreateSpec

log = logging.getLogger("kibotos.ctrl.model.workspace_records")

#: The node answers ``instance.create`` after its own admission, before the boot.
CREATE_TIMEOUT = 30.0

Commit = Callable[[str, str], Callable[[Session], dict[str, Any]]]
#: The ``instance.create`` arguments for a candidate node and a new Instance ID; may
#: refuse the candidate first (a `KibotosError`, taken as the node's refusal).
Args = Callable[[NodeEntry, str], Awaitable[CreateSpec]]


class PlacementLoop:
    """Places creates and starts (the module docstring) for `WorkspaceService`."""

    def __init__(self, runtime: Runtime, *, created: Callable[[str], None],
                 orphaned: Callable[[str, str], None]) -> None:
        self.runtime = runtime
        self.index = runtime.index
        self.created = created
        self.orphaned = orphaned

    async def place(self, demand: Demand, pinned: str | None, args: Args, commit: Commit,
                    journal: Callable[..., Any]) -> dict[str, Any]:
        """Try candidates best first until a node accepts; record the accepted one.
        Counted in ``kibotos_ctrl_placements_total`` (docs/metrics.md)."""
        operation = "create" if demand.pools is None else "start"
        metrics = self.runtime.ctx.metrics
        try:
            result = await self._place(demand, pinned, args, commit, journal)
        except KibotosError as exc:
            metrics.placement(operation, exc.code)
            raise
        metrics.placement(operation, "placed")
        return result

    async def _place(self, demand: Demand, pinned: str | None, args: Args, commit: Commit,
                     journal: Callable[..., Any]) -> dict[str, Any]:
        tried: set[str] = set()
        last: KibotosError | None = None
        while True:
            if pinned is not None:
                if pinned in tried:
                    assert last is not None
                    raise last
                refusal = self.index.verdict(pinned, demand)
                if refusal is not None:
                    raise refusal.error(pinned)
                node_id: str | None = pinned
            else:
                # Nodes whose session this replica holds first (a create placed
                # through another replica's session goes through the store's relay:
                # several transactions and a wake on each side, where a local one is
                # one round trip); the others when none of these can take it
                # (docs/replicas.md, "Placement").  A lone ctrl has no others.
                remote = self.runtime.ctx.sessions.elsewhere()
                node_id = self.index.best(demand, tried | remote) if remote else None
                if node_id is None:
                    node_id = self.index.best(demand, tried)
                if node_id is None:
                    raise _exhausted(self.index, demand, tried, last)
            assert node_id is not None
            tried.add(node_id)
            instance_id = ids.new_id("inst")
            try:
                return await self._try_node(node_id, instance_id, demand, args, commit,
                                            journal)
            except _NextNode as nxt:
                last = nxt.error

    async def _try_node(self, node_id: str, instance_id: str, demand: Demand, args: Args,
                        commit: Commit, journal: Callable[..., Any]) -> dict[str, Any]:
        index, inflight = self.index, self.runtime.inflight
        ctx = self.runtime.ctx
        entry = index.nodes[node_id]
        index.reserve(node_id, instance_id, demand.cpu_millis, demand.memory_bytes)
        done = inflight[instance_id] = trio.Event()
        accepted = committed = False
        try:
            try:
                await ctx.sessions.call(node_id, await args(entry, instance_id),
                                        CREATE_TIMEOUT)
                accepted = True
                ctx.metrics.node_answer("accepted")
            except KibotosError as exc:
                ctx.metrics.node_answer(_answer(exc))
                reason = exc.details.get("reason")
                if isinstance(exc, ResourceExhausted) and reason == "memory_tight":
                    index.mark_tight(node_id)
                    raise _NextNode(exc) from None
                if isinstance(exc, FailedPrecondition | ResourceExhausted):
                    # Drained meanwhile, or unable for a reason of its own: the node's
                    # verdict; unpinned placement goes on with the next candidate.
                    raise _NextNode(exc) from None
                if isinstance(exc, Unavailable | DeadlineExceeded):
                    # The node may have accepted after all: make sure it holds nothing.
                    accepted = isinstance(exc, DeadlineExceeded)
                    raise _NextNode(exc) from None
                raise
            try:
                result, replayed = await journal(commit(node_id, instance_id))
            except tx.Stale as exc:
                log.info("placement on %s went stale: %s", node_id, exc)
                raise _NextNode(Unavailable(str(exc))) from None
            committed = not replayed
            if committed:
                self.created(instance_id)
            return dict(result)
        finally:
            if not committed:
                index.unreserve(instance_id)
                if accepted:
                    self.orphaned(node_id, instance_id)
            del inflight[instance_id]
            done.set()


def _answer(exc: KibotosError) -> str:
    """The node's refusal as a label value from a small fixed set."""
    if isinstance(exc, ResourceExhausted) and exc.details.get("reason") == "memory_tight":
        return "memory_tight"
    if exc.details.get("reason") == "drained":
        return "drained"
    return exc.code


def _exhausted(index: CapacityIndex, demand: Demand, tried: set[str],
               last: KibotosError | None) -> ResourceExhausted:
    """Say why no node could take it: the count of nodes per refusal reason."""
    reasons: dict[str, int] = {}
    for entry in index.nodes.values():
        if entry.node_id in tried:
            reason = "refused by the node" if last is None else last.message
        else:
            refusal = admit(entry, demand)
            if refusal is None:
                continue
            reason = refusal.reason.split(" (")[0]
        reasons[reason] = reasons.get(reason, 0) + 1
    summary = "; ".join(f"{n} node(s): {r}" for r, n in sorted(reasons.items())) \
        or "no nodes are registered"
    message = (f"no node can take a Workspace of {format_cores(demand.cpu_millis)} CPU and "
               f"{format_bytes(demand.memory_bytes)} memory ({summary})")
    if reasons and all(" is not available" in r for r in reasons):
        # Only storage pools not (yet) seen available: after the storage is fixed ctrl
        # can take up to a minute to see it (spec: node-and-vmm-processes, Troubleshooting).
        message = f"no admitted node is ready: {message}; retry a little later"
    return ResourceExhausted(message, details={"reasons": reasons})


class _NextNode(Exception):
    """This node did not take it; try the next candidate."""

    def __init__(self, error: KibotosError) -> None:
        super().__init__(error.message)
        self.error = error
