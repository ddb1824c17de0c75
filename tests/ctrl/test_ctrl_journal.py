"""Command IDs and expected revisions: a write with a command ID happens once, its replay
returns the stored result (also after ctrl restarts), other input under the same ID is
refused, and a stale revision changes nothing."""

from __future__ import annotations

import httpx
import trio
from ctrl_helpers import enroll_node, error, read_node, result, update_node
from sqlalchemy import func, select

from kibotos.config import CtrlConfig
from kibotos.ctrl.api.app import build_app
from kibotos.ctrl.serve import build_context, build_services, open_store
from kibotos.ctrl.store.db import Store
from kibotos.ctrl.store.journal import input_digest
from kibotos.ctrl.store.models import Command
from kibotos.ctrl.wire.base import IsolateIn, VersionedWrite


async def _commands(store: Store) -> int:
    return int(await store.run(lambda s: s.scalar(select(func.count()).select_from(Command))))


async def test_replay_returns_the_stored_result(client: httpx.AsyncClient,
                                                operator: dict[str, str],
                                                store: Store) -> None:
    await enroll_node(client, operator, "node-a")
    body = {"command_id": "drain-a", "expected_version": 1}
    first = result(await client.post("/v1/nodes/node-a/drain", headers=operator, json=body))
    assert first["registration_version"] == 2
    assert first["status"] == "DRAINED"
    # The world moves on; the replay still answers what the write answered.
    await update_node(store, "node-a", instance_count=3)
    again = result(await client.post("/v1/nodes/node-a/drain", headers=operator, json=body))
    assert again == first
    assert (await read_node(store, "node-a")).registration_version == 2


async def test_concurrent_duplicates_run_once(client: httpx.AsyncClient,
                                              operator: dict[str, str],
                                              store: Store) -> None:
    """The same write sent several times at once (a client retrying over a slow link)
    is done once; every copy gets the one result."""
    await enroll_node(client, operator, "node-a")
    body = {"command_id": "drain-race", "expected_version": 1}
    answers: list[httpx.Response] = []

    async def send() -> None:
        answers.append(await client.post("/v1/nodes/node-a/drain", headers=operator,
                                         json=body))

    async with trio.open_nursery() as nursery:
        for _ in range(6):
            nursery.start_soon(send)
    results = [result(a) for a in answers]
    assert all(r == results[0] for r in results)
    assert (await read_node(store, "node-a")).registration_version == 2


async def test_same_id_other_input_is_refused(client: httpx.AsyncClient,
                                              operator: dict[str, str],
                                              store: Store) -> None:
    await enroll_node(client, operator, "node-a")
    await enroll_node(client, operator, "node-b")
    body = {"command_id": "op-1", "expected_version": 1}
    result(await client.post("/v1/nodes/node-a/drain", headers=operator, json=body))
    for path, other in [("/v1/nodes/node-a/drain", {"command_id": "op-1"}),
                        ("/v1/nodes/node-b/drain", body),
                        ("/v1/nodes/node-a/cancel-drain", body)]:
        err = error(await client.post(path, headers=operator, json=other), "already_exists")
        assert err["details"] == {"command_id": "op-1", "operation": "node.drain"}
        assert "op-1" in err["message"]
        assert "node.drain" in err["message"]
    node_b = await read_node(store, "node-b")
    assert not node_b.drain_requested
    assert node_b.registration_version == 1


async def test_replay_survives_a_ctrl_restart(ctrl_config: CtrlConfig, store: Store,
                                              client: httpx.AsyncClient,
                                              operator: dict[str, str]) -> None:
    await enroll_node(client, operator, "node-a")
    body = {"command_id": "drain-restart", "expected_version": 1}
    first = result(await client.post("/v1/nodes/node-a/drain", headers=operator, json=body))
    store.close()
    # A new process: new store connection, new context, new app, empty caches.
    reopened = await open_store(ctrl_config)
    try:
        app = build_app(build_services(build_context(ctrl_config, reopened)))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://ctrl") as fresh:
            again = result(await fresh.post("/v1/nodes/node-a/drain", headers=operator,
                                            json=body))
            assert again == first
            error(await fresh.post("/v1/nodes/node-a/drain", headers=operator,
                                   json={**body, "expected_version": 2}), "already_exists")
    finally:
        reopened.close()


async def test_stale_expected_version_changes_nothing(client: httpx.AsyncClient,
                                                      operator: dict[str, str],
                                                      store: Store) -> None:
    await enroll_node(client, operator, "node-a")
    before = await _commands(store)
    err = error(await client.post("/v1/nodes/node-a/drain", headers=operator,
                                  json={"command_id": "stale", "expected_version": 7}),
                "aborted")
    assert err["details"]["registration_version"] == 1
    node = await read_node(store, "node-a")
    assert not node.drain_requested
    assert node.registration_version == 1
    assert await _commands(store) == before
    # The same command ID is still free for the corrected request.
    done = result(await client.post("/v1/nodes/node-a/drain", headers=operator,
                                    json={"command_id": "stale", "expected_version": 1}))
    assert done["drain_requested"]


async def test_a_refusal_is_replayed_as_refused(client: httpx.AsyncClient,
                                                operator: dict[str, str],
                                                store: Store) -> None:
    await enroll_node(client, operator, "node-a")
    body = {"command_id": "retire-a", "expected_version": 1}
    first = error(await client.post("/v1/nodes/node-a/retire", headers=operator, json=body),
                  "failed_precondition")
    await update_node(store, "node-a", drain_requested=True)
    again = error(await client.post("/v1/nodes/node-a/retire", headers=operator, json=body),
                  "failed_precondition")
    assert again == first
    assert (await read_node(store, "node-a")).retired_at is None


async def test_bad_input_writes_no_journal_entry(client: httpx.AsyncClient,
                                                 operator: dict[str, str],
                                                 store: Store) -> None:
    await enroll_node(client, operator, "node-a")
    before = await _commands(store)
    error(await client.post("/v1/nodes/node-a/isolate", headers=operator,
                            json={"command_id": "iso"}), "invalid_argument")
    error(await client.put("/v1/nodes/node-a/overcommit", headers=operator,
                           json={"command_id": "oc", "cpu": "17"}), "invalid_argument")
    error(await client.post("/v1/nodes/node-a/drain", headers=operator,
                            json={"command_id": "bad id with spaces"}), "invalid_argument")
    assert await _commands(store) == before


async def test_writes_without_command_id_are_not_journaled(client: httpx.AsyncClient,
                                                           operator: dict[str, str],
                                                           store: Store) -> None:
    await enroll_node(client, operator, "node-a")
    before = await _commands(store)
    result(await client.post("/v1/nodes/node-a/drain", headers=operator, json={}))
    result(await client.post("/v1/nodes/node-a/drain", headers=operator, json={}))
    assert await _commands(store) == before
    assert (await read_node(store, "node-a")).registration_version == 3


def test_digest_covers_operation_params_and_body_but_not_the_id() -> None:
    a = VersionedWrite(command_id="x", expected_version=3)
    assert input_digest("node.drain", {"node_id": "n"}, a) == \
        input_digest("node.drain", {"node_id": "n"}, VersionedWrite(command_id="y",
                                                                    expected_version=3))
    # A field sent as null is the same input as a field left out.
    assert input_digest("node.drain", {"node_id": "n"}, VersionedWrite()) == \
        input_digest("node.drain", {"node_id": "n"}, VersionedWrite(expected_version=None))
    different = [
        input_digest("node.cancel_drain", {"node_id": "n"}, a),
        input_digest("node.drain", {"node_id": "m"}, a),
        input_digest("node.drain", {"node_id": "n"}, VersionedWrite(expected_version=4)),
        input_digest("node.isolate", {"node_id": "n"},
                     IsolateIn(expected_version=3, confirm_host_cannot_write=True)),
    ]
    base = input_digest("node.drain", {"node_id": "n"}, a)
    assert base not in different
    assert len(set(different)) == len(different)
