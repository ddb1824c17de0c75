"""The placement loop of creates and starts: candidates best first, each asked to
accept the Instance, the first acceptance recorded (docs/architecture.md, "Placement").

The capacity is reserved in the index before the node is asked, and given back if the
Instance is not recorded (refused, or the record went stale, or a replay won); an
Instance a node may have accepted but that is not recorded is destroyed.  Refusals that
say "not now, not here" (memory tight, drained, any failed_precondition or
resource_exhausted, a lost or silent session) move on to the next candidate; with
``--node`` there is none, and the node's refusal is the answer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio
from sqlalchemy.orm import Session

from kibotos import ids
from kibotos.ctrl.model import workspace_txns as tx
from kibotos.ctrl.model.placement import Demand, NodeEntry, admit
from kibotos.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    KibotosError,
    ResourceExhausted,
    Unavailable,
)
from kibotos.protocol import CreateSpec
from kibotos.units import format_bytes, format_cores

if TYPE_CHECKING:
    from kibotos.ctrl.live.workspace_service import WorkspaceService

log = logging.getLogger("kibotos.ctrl.model.workspace_records")

#: The node answers ``instance.create`` after its own admission, before the boot.
CREATE_TIMEOUT = 30.0

Commit = Callable[[str, str], Callable[[Session], dict[str, Any]]]
#: The ``instance.create`` arguments for a candidate node and a new Instance ID.
Args = Callable[[NodeEntry, str], CreateSpec]


async def place(service: WorkspaceService, demand: Demand, pinned: str | None,
                args: Args, commit: Commit, journal: Callable[..., Any]) -> dict[str, Any]:
    """Try candidates best first until a node accepts; record the accepted one.
    Counted in ``kibotos_ctrl_placements_total`` (docs/metrics.md)."""
    operation = "create" if demand.pools is None else "start"
    try:
        result = await _place(service, demand, pinned, args, commit, journal)
    except KibotosError as exc:
        service.ctx.metrics.placement(operation, exc.code)
        raise
    service.ctx.metrics.placement(operation, "placed")
    return result


async def _place(service: WorkspaceService, demand: Demand, pinned: str | None,
                 args: Args, commit: Commit, journal: Callable[..., Any]) -> dict[str, Any]:
    tried: set[str] = set()
    last: KibotosError | None = None
    while True:
        if pinned is not None:
            if pinned in tried:
                assert last is not None
                raise last
            refusal = service.index.verdict(pinned, demand)
            if refusal is not None:
                raise refusal.error(pinned)
            node_id: str | None = pinned
        else:
            node_id = service.index.best(demand, tried)
            if node_id is None:
                raise _exhausted(service, demand, tried, last)
        assert node_id is not None
        tried.add(node_id)
        instance_id = ids.new_id("inst")
        try:
            return await _try_node(service, node_id, instance_id, demand, args, commit,
                                   journal)
        except _NextNode as nxt:
            last = nxt.error


async def _try_node(service: WorkspaceService, node_id: str, instance_id: str,
                    demand: Demand, args: Args, commit: Commit,
                    journal: Callable[..., Any]) -> dict[str, Any]:
    entry = service.index.nodes[node_id]
    service.index.reserve(node_id, instance_id, demand.cpu_millis, demand.memory_bytes)
    done = service.inflight[instance_id] = trio.Event()
    accepted = committed = False
    try:
        try:
            await service.ctx.sessions.call(node_id, args(entry, instance_id),
                                            CREATE_TIMEOUT)
            accepted = True
            service.ctx.metrics.node_answer("accepted")
        except KibotosError as exc:
            service.ctx.metrics.node_answer(_answer(exc))
            reason = exc.details.get("reason")
            if isinstance(exc, ResourceExhausted) and reason == "memory_tight":
                service.index.mark_tight(node_id)
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
            service.feed.remember(instance_id, ("CREATING", None))
        return dict(result)
    finally:
        if not committed:
            service.index.unreserve(instance_id)
            if accepted:
                service.tasks.spawn(service.tasks.destroy_orphan, node_id, instance_id)
        del service.inflight[instance_id]
        done.set()


def _answer(exc: KibotosError) -> str:
    """The node's refusal as a label value from a small fixed set."""
    if isinstance(exc, ResourceExhausted) and exc.details.get("reason") == "memory_tight":
        return "memory_tight"
    if exc.details.get("reason") == "drained":
        return "drained"
    return exc.code


def _exhausted(service: WorkspaceService, demand: Demand, tried: set[str],
               last: KibotosError | None) -> ResourceExhausted:
    """Say why no node could take it: the count of nodes per refusal reason."""
    reasons: dict[str, int] = {}
    for entry in service.index.nodes.values():
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
