"""HTTP API of nodes and overcommit (spec/nodes.txt): list, get, drain, cancel-drain,
isolate, retire, overcommit get / set-default / set.

Each write is one journaled transaction (`journal.py`); what must happen outside the
store (closing a retired node's session, telling nodes a new ratio) runs after the
commit, and only for a write done now, not for a replay.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from functools import partial
from typing import Any

from sqlalchemy.orm import Session
from starlette.requests import Request

from kibotos.ctrl.api.auth import Caller
from kibotos.ctrl.api.routing import (
    Api,
    Route,
    path_node_id,
    query_read,
    read_body,
    require_true,
)
from kibotos.ctrl.model import nodes, overcommit
from kibotos.ctrl.model.node_view import node_json
from kibotos.ctrl.pools import facts as pool_facts
from kibotos.ctrl.store.models import Node
from kibotos.ctrl.wire.base import (
    IsolateIn,
    IsolateOut,
    NodeListOut,
    NodeListQuery,
    NodeOut,
    OvercommitDefaultIn,
    OvercommitNodeIn,
    OvercommitOut,
    VersionedWrite,
)
from kibotos.protocol import CloseReason

NodeOp = Callable[[Session, str, int | None, datetime], Node]


def _list(query: NodeListQuery, session: Session) -> dict[str, Any]:
    rows, token = nodes.list_page(session, query.page_size, query.page_token)
    default = overcommit.get_default(session)
    return {"nodes": [node_json(n, default) for n in rows], "next_page_token": token}


def _get(node_id: str, session: Session) -> dict[str, Any]:
    node = nodes.get_node(session, node_id)
    return node_json(node, overcommit.get_default(session), with_usage=True)


def _retire(session: Session, node_id: str, expected: int | None, now: datetime) -> Node:
    """Retire, then let another storage or host take the pool IDs the node held."""
    node = nodes.retire(session, node_id, expected, now)
    pool_facts.reconsider(session, now)
    return node


def routes(api: Api) -> list[Route]:
    ctx = api.ctx

    list_nodes = query_read("list_nodes", api, NodeListQuery, _list)

    async def get_node(request: Request, caller: Caller | None) -> dict[str, Any]:
        return await ctx.store.run(partial(_get, path_node_id(request)))

    async def _simple(request: Request, caller: Caller | None, operation: str,
                      op: NodeOp) -> dict[str, Any]:
        assert caller is not None
        node_id = path_node_id(request)
        body = await read_body(request, VersionedWrite)

        def txn(session: Session) -> dict[str, Any]:
            node = op(session, node_id, body.expected_version, ctx.now())
            session.flush()
            return node_json(node, overcommit.get_default(session))

        outcome = await api.journal.execute(
            operation=operation, params={"node_id": node_id}, body=body,
            identity_id=caller.identity_id, fn=txn)
        if operation == "node.retire" and not outcome.replayed:
            await ctx.sessions.close(node_id, CloseReason.RETIRED)
        return outcome.result

    async def drain(request: Request, caller: Caller | None) -> dict[str, Any]:
        return await _simple(request, caller, "node.drain", nodes.drain)

    async def cancel_drain(request: Request, caller: Caller | None) -> dict[str, Any]:
        return await _simple(request, caller, "node.cancel_drain", nodes.cancel_drain)

    async def retire(request: Request, caller: Caller | None) -> dict[str, Any]:
        return await _simple(request, caller, "node.retire", _retire)

    async def isolate(request: Request, caller: Caller | None) -> dict[str, Any]:
        assert caller is not None
        node_id = path_node_id(request)
        body = await read_body(request, IsolateIn)
        require_true(body.confirm_host_cannot_write, "confirm_host_cannot_write",
                     "isolate asserts that the host is powered off or can no longer write "
                     "to any of its storage pools")
        alive_here = ctx.sessions.is_alive(node_id)

        def txn(session: Session) -> dict[str, Any]:
            node, counts = nodes.isolate(session, node_id, body.expected_version, ctx.now(),
                                         alive_here=alive_here,
                                         releasers=ctx.isolate_releasers)
            session.flush()
            return {"node": node_json(node, overcommit.get_default(session)),
                    "released_volumes": counts.released_volumes,
                    "released_retained_layers": counts.released_retained_layers,
                    "failed_workspaces": counts.failed_workspaces}

        return await api.journaled("node.isolate", {"node_id": node_id}, body, caller, txn)

    async def overcommit_get(request: Request, caller: Caller | None) -> dict[str, Any]:
        return await ctx.store.run(overcommit.overview)

    async def overcommit_set_default(request: Request,
                                     caller: Caller | None) -> dict[str, Any]:
        assert caller is not None
        body = await read_body(request, OvercommitDefaultIn)
        changed: list[str] = []

        def txn(session: Session) -> dict[str, Any]:
            changed.extend(overcommit.set_default(session, body.cpu, body.memory,
                                                  body.expected_version, ctx.now()))
            session.flush()
            return overcommit.overview(session)

        outcome = await api.journal.execute(
            operation="overcommit.set_default", params={}, body=body,
            identity_id=caller.identity_id, fn=txn)
        if not outcome.replayed:
            for node_id in changed:
                ctx.sessions.push_overcommit(node_id)
        return outcome.result

    async def overcommit_set(request: Request, caller: Caller | None) -> dict[str, Any]:
        assert caller is not None
        node_id = path_node_id(request)
        body = await read_body(request, OvercommitNodeIn)
        changed: list[bool] = []

        def txn(session: Session) -> dict[str, Any]:
            node, did_change = overcommit.set_node(session, node_id, body.cpu, body.memory,
                                                   body.expected_version, ctx.now())
            changed.append(did_change)
            session.flush()
            return node_json(node, overcommit.get_default(session))

        outcome = await api.journal.execute(
            operation="overcommit.set", params={"node_id": node_id}, body=body,
            identity_id=caller.identity_id, fn=txn)
        if not outcome.replayed and changed and changed[0]:
            ctx.sessions.push_overcommit(node_id)
        return outcome.result

    return [
        Route("GET", "/v1/nodes", list_nodes, "List nodes in node_id order, one page at a time",
              query=NodeListQuery, result=NodeListOut),
        Route("GET", "/v1/nodes/{node_id}", get_node, "One node, with its latest host usage sample",
              result=NodeOut),
        Route("POST", "/v1/nodes/{node_id}/drain", drain, "Stop placing new Workspaces on the node",
              body=VersionedWrite, result=NodeOut),
        Route("POST", "/v1/nodes/{node_id}/cancel-drain", cancel_drain,
              "Restore placement on a drained node", body=VersionedWrite, result=NodeOut),
        Route("POST", "/v1/nodes/{node_id}/isolate", isolate,
              "Declare that a node's host can no longer write; release what it held",
              body=IsolateIn, result=IsolateOut),
        Route("POST", "/v1/nodes/{node_id}/retire", retire,
              "Retire a DRAINED or isolated node, finally", body=VersionedWrite, result=NodeOut),
        Route("GET", "/v1/overcommit", overcommit_get,
              "The cluster-wide overcommit default and the per-node overrides",
              result=OvercommitOut),
        Route("PUT", "/v1/overcommit/default", overcommit_set_default,
              "Change the cluster-wide overcommit default", body=OvercommitDefaultIn,
              result=OvercommitOut),
        Route("PUT", "/v1/nodes/{node_id}/overcommit", overcommit_set,
              "Set or clear one node's overcommit override", body=OvercommitNodeIn, result=NodeOut),
    ]
