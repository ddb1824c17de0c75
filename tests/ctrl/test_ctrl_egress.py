"""Egresses and Resolvers through the real HTTP API of a real ctrl: versioned records,
strict input, the password sealed at rest and never in a list, get, journal entry or
log line, the credentials endpoint's permission rules (a node running an Instance that
was sent the revision, nobody else), and the delete refusals."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
from ctrl_helpers import wait_until
from sqlalchemy import select
from sqlalchemy.orm import Session
from ws_helpers import WsCtrl, events, open_ws_ctrl

from kibotos.ctrl.store.models import Command, EgressRevision
from kibotos.ctrl.wire.network import (
    EgressCredentialsOut,
    EgressListOut,
    EgressOut,
    EgressUpdateOut,
    ResolverListOut,
    ResolverOut,
)
from kibotos.protocol import Args, SetNetworkArgs

PUBLIC = {"public_egress": True}
SECRET = "correct-horse-battery-staple"
OTHER_SECRET = "tr0ub4dor-and-3"


async def add_egress(ctrl: WsCtrl, name: str = "corp", **body: Any) -> dict[str, Any]:
    return dict(await ctrl.call("POST", "/v1/egresses", json={
        "name": name, "address": "proxy.example:1080", "username": "alice",
        "password": SECRET, **body}))


async def as_node(ctrl: WsCtrl, node_id: str, path: str, **params: Any) -> httpx.Response:
    return await ctrl.http.get(path, params=params,
                               headers={"Authorization": f"Bearer {ctrl.creds[node_id]}"})


async def egress_revision_in_force(ctrl: WsCtrl, workspace_id: str, revision: int) -> None:
    async def switched() -> bool:
        inst = (await ctrl.ws(workspace_id))["instance"]
        return bool(inst["network"]["egress"]["revision"] == revision)

    await wait_until(switched, f"egress revision {revision} in force")


def everything_stored(ctrl: WsCtrl) -> bytes:
    """Every byte ctrl keeps on disk (the SQLite database, its journal files, the state
    directory), to search for a secret."""
    state = Path(ctrl.ctx.config.ctrl.state_dir)
    return b"".join(p.read_bytes() for p in sorted(state.rglob("*")) if p.is_file())


async def test_create_get_list_show_no_password(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with open_ws_ctrl(tmp_path) as ctrl:
        created = await add_egress(ctrl, command_id="e-1")
        EgressOut.model_validate(created)
        assert {k: created[k] for k in ("name", "address", "authenticated", "username",
                                        "revision")} == {
            "name": "corp", "address": "proxy.example:1080", "authenticated": True,
            "username": "alice", "revision": 1}
        plain = await ctrl.call("POST", "/v1/egresses", json={
            "name": "open", "address": "[2001:db8::1]:1080"})
        assert (plain["authenticated"], plain["username"]) == (False, None)
        listed = await ctrl.call("GET", "/v1/egresses")
        EgressListOut.model_validate(listed)
        assert [e["name"] for e in listed["egresses"]] == ["corp", "open"]
        got = await ctrl.call("GET", "/v1/egresses/corp")
        assert got == created
        for text in (str(created), str(listed), str(got)):
            assert SECRET not in text
        # Not in the store's files (sealed), the journal, or any log line.
        assert SECRET.encode() not in everything_stored(ctrl)

        def journal(session: Session) -> list[Any]:
            return [(c.result, c.error, c.input_digest) for c in session.scalars(
                select(Command))]

        assert SECRET not in str(await ctrl.ctx.store.run(journal))
        assert SECRET not in caplog.text


async def test_updates_make_revisions(tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await add_egress(ctrl)
        out = await ctrl.call("POST", "/v1/egresses/corp/update",
                              json={"address": "proxy2.example:1081"})
        EgressUpdateOut.model_validate(out)
        assert out["outcome"] == "updated"
        assert (out["egress"]["revision"], out["egress"]["address"],
                out["egress"]["authenticated"]) == (2, "proxy2.example:1081", True)
        same = await ctrl.call("POST", "/v1/egresses/corp/update",
                               json={"address": "PROXY2.example:1081"})
        assert (same["outcome"], same["egress"]["revision"]) == ("unchanged", 2)
        same = await ctrl.call("POST", "/v1/egresses/corp/update",
                               json={"username": "alice", "password": SECRET})
        assert same["outcome"] == "unchanged"
        out = await ctrl.call("POST", "/v1/egresses/corp/update",
                              json={"username": "bob", "password": OTHER_SECRET})
        assert (out["egress"]["revision"], out["egress"]["username"]) == (3, "bob")
        err = await ctrl.call("POST", "/v1/egresses/corp/update", code="aborted",
                              json={"clear_credentials": True, "expected_version": 2})
        assert err["details"]["revision"] == 3
        out = await ctrl.call("POST", "/v1/egresses/corp/update",
                              json={"clear_credentials": True, "expected_version": 3})
        assert (out["egress"]["revision"], out["egress"]["authenticated"]) == (4, False)
        await ctrl.call("POST", "/v1/egresses/nope/update", code="not_found",
                        json={"address": "p:1"})
        err = await ctrl.call("POST", "/v1/egresses", code="already_exists", json={
            "name": "corp", "address": "p:1"})
        assert "already exists" in err["message"]

        # Revisions no live Instance references are not kept: only the current one.
        def revisions(session: Session) -> list[int]:
            return list(session.scalars(select(EgressRevision.revision)))

        assert await ctrl.ctx.store.run(revisions) == [4]


async def test_a_replay_with_another_password_is_other_input(tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        first = await add_egress(ctrl, command_id="e-1")
        assert await add_egress(ctrl, command_id="e-1") == first
        err = await ctrl.call("POST", "/v1/egresses", code="already_exists", json={
            "name": "corp", "address": "proxy.example:1080", "username": "alice",
            "password": OTHER_SECRET, "command_id": "e-1"})
        assert err["details"] == {"command_id": "e-1", "operation": "egress.create"}


@pytest.mark.parametrize(("body", "field"), [
    ({"address": "proxy.example"}, "address"),
    ({"address": "proxy.example:0"}, "address"),
    ({"address": "proxy.example:65536"}, "address"),
    ({"address": "proxy.example:01080"}, "address"),
    ({"address": "proxy.example:١٠٨٠"}, "address"),
    ({"address": "2001:db8::1:1080"}, "address"),
    ({"address": "0.0.0.0:1080"}, "address"),
    ({"address": 1080}, "address"),
    ({"name": "Corp"}, "name"),
    ({"name": "-corp"}, "name"),
    ({"username": "alice", "password": None}, "body"),
    ({"password": SECRET, "username": None}, "body"),
    ({"password": "x" * 256}, "password"),
    ({"password": 12345}, "password"),
    ({"username": "a\nb"}, "username"),
    ({"colour": "blue"}, "colour"),
])
async def test_bad_egresses_are_refused_naming_the_field(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, body: dict[str, Any],
        field: str) -> None:
    caplog.set_level(logging.DEBUG)
    async with open_ws_ctrl(tmp_path) as ctrl:
        full = {"name": "corp", "address": "proxy.example:1080", "username": "alice",
                "password": SECRET, **body}
        full = {k: v for k, v in full.items() if v is not None}
        err = await ctrl.call("POST", "/v1/egresses", code="invalid_argument", json=full)
        assert field in [f["field"] for f in err["details"]["fields"]], err
        assert SECRET not in str(err)
        assert (await ctrl.call("GET", "/v1/egresses"))["egresses"] == []
        assert SECRET not in caplog.text


@pytest.mark.parametrize("body", [
    {}, {"username": "bob"}, {"clear_credentials": True, "username": "b", "password": "p"},
    {"clear_credentials": "yes"}, {"address": "p:1", "expected_version": "1"},
])
async def test_bad_updates_change_nothing(tmp_path: Path, body: dict[str, Any]) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await add_egress(ctrl)
        await ctrl.call("POST", "/v1/egresses/corp/update", code="invalid_argument",
                        json=body)
        assert (await ctrl.call("GET", "/v1/egresses/corp"))["revision"] == 1


async def test_credentials_only_for_a_node_running_that_revision(tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a", network=PUBLIC)
        await ctrl.connect("node-b", network=PUBLIC)
        await add_egress(ctrl)
        path = "/v1/egresses/corp/credentials"
        # Nobody runs it yet.
        resp = await as_node(ctrl, "node-a", path, revision=1)
        assert (resp.status_code, resp.json()["error"]["code"]) == (403, "permission_denied")
        ws = await ctrl.create(node_id="node-a", network={"egress": "corp"})
        await ctrl.settled(ws["workspace_id"])
        resp = await as_node(ctrl, "node-a", path, revision=1)
        assert resp.status_code == 200, resp.json()
        creds = EgressCredentialsOut.model_validate(resp.json()["result"])
        assert (creds.username, creds.password, creds.address) == (
            "alice", SECRET, "proxy.example:1080")
        # Not another node, not an operator, not another revision.
        for node_id in ("node-b",):
            resp = await as_node(ctrl, node_id, path, revision=1)
            assert resp.json()["error"]["code"] == "permission_denied"
        resp = await ctrl.http.get(path, params={"revision": 1}, headers=ctrl.operator)
        assert resp.json()["error"]["code"] == "permission_denied"
        resp = await ctrl.http.get(path, params={"revision": 1})
        assert resp.json()["error"]["code"] == "unauthenticated"
        # A new revision goes to the running Workspace (a switch, policy unchanged).
        await ctrl.call("POST", "/v1/egresses/corp/update",
                        json={"username": "bob", "password": OTHER_SECRET})
        await egress_revision_in_force(ctrl, ws["workspace_id"], 2)
        [switch] = [c["args"] for c in ctrl.sims["node-a"].commands
                    if c["kind"] == "instance.set_network"]
        assert switch["network"]["egress"] == {
            "name": "corp", "revision": 2, "address": "proxy.example:1080",
            "authenticated": True}
        [event] = [e for e in await events(ctrl, ws["workspace_id"]) if e["kind"] == "network"]
        assert event["cause"] == "egress corp changed"
        resp = await as_node(ctrl, "node-a", path, revision=2)
        assert resp.json()["result"]["password"] == OTHER_SECRET
        resp = await as_node(ctrl, "node-a", path, revision=1)
        assert resp.json()["error"]["code"] == "permission_denied"
        # Bad queries are bad input.
        for params in ({}, {"revision": "0"}, {"revision": "x"}):
            resp = await as_node(ctrl, "node-a", path, **params)
            assert resp.json()["error"]["code"] == "invalid_argument"
        # A stopped Workspace's node no longer gets it.
        await ctrl.action(ws["workspace_id"], "stop")
        await ctrl.settled(ws["workspace_id"])
        resp = await as_node(ctrl, "node-a", path, revision=2)
        assert resp.json()["error"]["code"] == "permission_denied"


async def test_the_node_may_fetch_while_it_is_being_sent_the_revision(
        tmp_path: Path) -> None:
    """The node fetches the credentials while it handles the create or the switch,
    before ctrl recorded what it sent."""
    async with open_ws_ctrl(tmp_path) as ctrl:
        node = await ctrl.connect("node-a", network=PUBLIC)
        assert node.sim is not None
        await add_egress(ctrl)
        fetched: list[Any] = []

        async def fetch(args: Args) -> None:
            network = getattr(args, "network", None)
            if network is not None and network.egress is not None:
                resp = await as_node(ctrl, "node-a", "/v1/egresses/corp/credentials",
                                     revision=network.egress.revision)
                fetched.append((type(args).__name__, resp.json()))

        node.sim.before_command = fetch
        ws = await ctrl.create(network={"egress": "corp"})
        await ctrl.settled(ws["workspace_id"])
        await ctrl.call("POST", "/v1/egresses/corp/update", json={"address": "p2:1080"})
        await egress_revision_in_force(ctrl, ws["workspace_id"], 2)
        assert [(kind, body["result"]["revision"]) for kind, body in fetched] == [
            ("CreateSpec", 1), (SetNetworkArgs.__name__, 2)]
        # Once it is over, the grant is gone: a revision nobody runs is refused.
        resp = await as_node(ctrl, "node-a", "/v1/egresses/corp/credentials", revision=1)
        assert resp.json()["error"]["code"] == "permission_denied"


async def test_a_node_away_keeps_the_revision_it_was_sent(tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a", network=PUBLIC)
        await add_egress(ctrl)
        ws = await ctrl.create(network={"egress": "corp"})
        await ctrl.settled(ws["workspace_id"])
        await ctrl.disconnect("node-a")
        await ctrl.call("POST", "/v1/egresses/corp/update",
                        json={"username": "bob", "password": OTHER_SECRET})
        path = "/v1/egresses/corp/credentials"
        # The switch cannot reach the node: its Instance keeps revision 1, whose
        # credentials stay stored and fetchable (over HTTP, not the session).
        got = await ctrl.ws(ws["workspace_id"])
        assert got["instance"]["network"]["egress"]["revision"] == 1
        resp = await as_node(ctrl, "node-a", path, revision=1)
        assert resp.json()["result"]["password"] == SECRET
        resp = await as_node(ctrl, "node-a", path, revision=2)
        assert resp.json()["error"]["code"] == "permission_denied"
        # Back, set-network (or a restart) gives it the current one.
        await ctrl.connect("node-a", network=PUBLIC)
        await ctrl.action(ws["workspace_id"], "set-network", network={"egress": "corp"})
        resp = await as_node(ctrl, "node-a", path, revision=2)
        assert resp.json()["result"]["password"] == OTHER_SECRET


async def test_an_isolated_node_gets_no_secret(tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a", network=PUBLIC)
        await add_egress(ctrl)
        ws = await ctrl.create(network={"egress": "corp"})
        await ctrl.settled(ws["workspace_id"])
        path = "/v1/egresses/corp/credentials"
        assert (await as_node(ctrl, "node-a", path, revision=1)).status_code == 200
        await ctrl.disconnect("node-a")
        # Its Instance is still recorded as running there until it is isolated.
        assert (await as_node(ctrl, "node-a", path, revision=1)).status_code == 200
        await ctrl.call("POST", "/v1/nodes/node-a/isolate",
                        json={"confirm_host_cannot_write": True})
        resp = await as_node(ctrl, "node-a", path, revision=1)
        assert resp.json()["error"]["code"] == "permission_denied"


async def test_resolvers(tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        out = await ctrl.call("POST", "/v1/resolvers", json={
            "name": "dns", "upstream": "2001:db8::53"})
        ResolverOut.model_validate(out)
        assert (out["upstream"], out["via_egress"], out["revision"]) == (
            "[2001:db8::53]:53", None, 1)
        await ctrl.call("POST", "/v1/resolvers", code="not_found", json={
            "name": "via", "upstream": "dns.example:5353", "via_egress": "corp"})
        await add_egress(ctrl)
        via = await ctrl.call("POST", "/v1/resolvers", json={
            "name": "via", "upstream": "DNS.example:5353", "via_egress": "corp"})
        assert via["upstream"] == "dns.example:5353"
        listed = await ctrl.call("GET", "/v1/resolvers")
        ResolverListOut.model_validate(listed)
        assert [r["name"] for r in listed["resolvers"]] == ["dns", "via"]
        assert await ctrl.call("GET", "/v1/resolvers/via") == via
        await ctrl.call("POST", "/v1/resolvers", code="already_exists", json={
            "name": "dns", "upstream": "10.0.0.53"})
        for bad in ({"upstream": "10.0.0.53:0"}, {"upstream": "dns example"},
                    {"upstream": "[10.0.0.53]:53"}, {"via_egress": "Corp"},
                    {"upstream": 53}, {"name": "x."}):
            await ctrl.call("POST", "/v1/resolvers", code="invalid_argument",
                            json={"name": "new", "upstream": "10.0.0.53", **bad})
        await ctrl.call("GET", "/v1/resolvers/new", code="not_found")
        await ctrl.call("GET", "/v1/resolvers/BAD", code="invalid_argument")


async def test_deletes_are_refused_while_in_use(tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a", network=PUBLIC)
        await add_egress(ctrl)
        await ctrl.call("POST", "/v1/resolvers", json={"name": "dns", "upstream": "10.0.0.53"})
        await ctrl.call("POST", "/v1/resolvers", json={
            "name": "via", "upstream": "10.0.0.54", "via_egress": "corp"})
        ws = await ctrl.create(network={"egress": "corp", "resolver": "dns"})
        wid = ws["workspace_id"]
        await ctrl.settled(wid)
        await ctrl.action(wid, "stop")
        await ctrl.settled(wid)  # STOPPED still references them
        err = await ctrl.call("DELETE", "/v1/egresses/corp", code="failed_precondition")
        assert err["details"]["workspaces"] == [wid]
        assert wid in err["message"]
        err = await ctrl.call("DELETE", "/v1/resolvers/dns", code="failed_precondition")
        assert err["details"]["workspaces"] == [wid]
        await ctrl.action(wid, "set-network", network={"resolver": "dns"})
        err = await ctrl.call("DELETE", "/v1/egresses/corp", code="failed_precondition")
        assert err["details"]["resolvers"] == ["via"]
        deleted = await ctrl.call("DELETE", "/v1/resolvers/via", json={"expected_version": 1})
        assert deleted["name"] == "via"
        err = await ctrl.call("DELETE", "/v1/egresses/corp", code="aborted",
                              json={"expected_version": 7})
        gone = await ctrl.call("DELETE", "/v1/egresses/corp", json={"command_id": "d-1"})
        assert gone["name"] == "corp"
        assert await ctrl.call("DELETE", "/v1/egresses/corp",
                               json={"command_id": "d-1"}) == gone
        await ctrl.call("GET", "/v1/egresses/corp", code="not_found")
        await ctrl.action(wid, "delete")
        assert (await ctrl.settled(wid))["state"] == "DELETED"
        assert (await ctrl.call("DELETE", "/v1/resolvers/dns"))["name"] == "dns"

        def revisions(session: Session) -> list[Any]:
            return list(session.scalars(select(EgressRevision)))

        assert await ctrl.ctx.store.run(revisions) == []


async def test_egress_routes_are_for_operators(tmp_path: Path) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        await ctrl.connect("node-a")
        for method, path in (("GET", "/v1/egresses"), ("POST", "/v1/egresses"),
                             ("GET", "/v1/resolvers")):
            resp = await ctrl.http.request(
                method, path, json={}, headers={"Authorization": f"Bearer {ctrl.creds['node-a']}"})
            assert resp.json()["error"]["code"] == "permission_denied"
