"""Enrollment against a small real HTTP server on loopback that plays ctrl's exchange."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from node_helpers import node_config

from kibotos.core import failpoints
from kibotos.core.errors import FailedPrecondition
from kibotos.node.session.identity import ensure_identity, load_identity, public_key_b64

GRANT = "kgr-01k6test.c2VjcmV0LXNlY3JldA"


class ExchangeServer:
    """Answers POST /v1/enrollment/exchange from a queue of (status, body) answers; the
    last answer repeats.  Records every request body."""

    def __init__(self) -> None:
        self.answers: list[tuple[int, dict[str, Any]]] = []
        self.requests: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length))
                outer.requests.append({"path": self.path, **body})
                status, answer = (outer.answers.pop(0) if len(outer.answers) > 1
                                  else outer.answers[0])
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                       daemon=True)

    def ok(self, node_id: str = "node-a", kind: str = "node") -> dict[str, Any]:
        return {"result": {"identity_id": "kid-01k6node", "credential": "kid-01k6node:s3cr3t",
                           "kind": kind, "node_id": node_id}}


@pytest.fixture
def exchange() -> Iterator[ExchangeServer]:
    srv = ExchangeServer()
    srv.thread.start()
    try:
        yield srv
    finally:
        srv.server.shutdown()
        srv.server.server_close()
        srv.thread.join()


def _config(tmp_path: Path, url: str, grant: str | None = GRANT):
    grant_file = tmp_path / "grant"
    if grant is not None:
        grant_file.write_text(grant + "\n")
    return node_config(tmp_path, ctrl_url=url, grant_file=grant_file)


async def test_enroll_once_and_store_the_identity(tmp_path: Path, exchange) -> None:
    exchange.answers = [(200, exchange.ok())]
    config = _config(tmp_path, exchange.url)
    path = tmp_path / "identity.json"
    identity = await ensure_identity(config, path)
    assert identity.credential == "kid-01k6node:s3cr3t"
    assert identity.identity_id == "kid-01k6node"
    (request,) = exchange.requests
    assert request["path"] == "/v1/enrollment/exchange"
    assert request["token"] == GRANT
    # The public key sent is the raw Ed25519 key of the private key stored.
    raw = base64.b64decode(request["public_key"])
    Ed25519PublicKey.from_public_bytes(raw)
    assert request["public_key"] == public_key_b64(identity.private_key())
    assert path.stat().st_mode & 0o777 == 0o600
    stored = json.loads(path.read_text())
    assert stored["credential"] == identity.credential
    assert stored["private_key"].startswith("-----BEGIN PRIVATE KEY-----")
    # A second start uses the stored identity and never exchanges again.
    again = await ensure_identity(config, path)
    assert again == identity
    assert len(exchange.requests) == 1
    assert load_identity(path) == identity


@pytest.mark.parametrize("grant", [None, "", "  \n"])
async def test_missing_or_empty_grant(tmp_path: Path, exchange, grant) -> None:
    config = _config(tmp_path, exchange.url, grant)
    with pytest.raises(FailedPrecondition, match=r"enrollment grant file .* (does not exist|is "
                                                 "empty)"):
        await ensure_identity(config, tmp_path / "identity.json")
    assert exchange.requests == []
    assert not (tmp_path / "identity.json").exists()


async def test_no_grant_file_configured(tmp_path: Path) -> None:
    config = node_config(tmp_path)
    with pytest.raises(FailedPrecondition, match="enrollment_grant_file is not set"):
        await ensure_identity(config, tmp_path / "identity.json")


async def test_refused_exchange(tmp_path: Path, exchange) -> None:
    exchange.answers = [(403, {"error": {"code": "permission_denied",
                                         "message": "grant was already exchanged"}})]
    config = _config(tmp_path, exchange.url)
    with pytest.raises(FailedPrecondition,
                       match=r"enrollment refused by ctrl \(403\): grant was already exchanged"):
        await ensure_identity(config, tmp_path / "identity.json")
    assert not (tmp_path / "identity.json").exists()


async def test_grant_for_another_node(tmp_path: Path, exchange) -> None:
    exchange.answers = [(200, exchange.ok(node_id="node-b"))]
    config = _config(tmp_path, exchange.url)
    with pytest.raises(FailedPrecondition, match="issued for node 'node-b'"):
        await ensure_identity(config, tmp_path / "identity.json")
    assert not (tmp_path / "identity.json").exists()


async def test_operator_grant_is_refused(tmp_path: Path, exchange) -> None:
    exchange.answers = [(200, exchange.ok(kind="operator"))]
    config = _config(tmp_path, exchange.url)
    with pytest.raises(FailedPrecondition, match="kind 'operator', not a node"):
        await ensure_identity(config, tmp_path / "identity.json")


async def test_unavailable_ctrl_is_retried(tmp_path: Path, exchange) -> None:
    exchange.answers = [(503, {"error": {"code": "unavailable", "message": "starting"}}),
                        (200, exchange.ok())]
    config = _config(tmp_path, exchange.url)
    identity = await ensure_identity(config, tmp_path / "identity.json")
    assert identity.node_id == "node-a"
    assert len(exchange.requests) == 2


async def test_crash_after_exchange_leaves_no_identity(tmp_path: Path, exchange,
                                                       monkeypatch) -> None:
    exchange.answers = [(200, exchange.ok())]
    config = _config(tmp_path, exchange.url)
    monkeypatch.setenv(failpoints.ENV, "node.enroll.after-exchange=error")
    failpoints.reload()
    try:
        with pytest.raises(failpoints.FailpointError):
            await ensure_identity(config, tmp_path / "identity.json")
    finally:
        monkeypatch.delenv(failpoints.ENV)
        failpoints.reload()
    assert len(exchange.requests) == 1
    assert not (tmp_path / "identity.json").exists()


def test_damaged_identity_file(tmp_path: Path) -> None:
    path = tmp_path / "identity.json"
    path.write_text('{"identity_id": "x"}')
    with pytest.raises(FailedPrecondition, match="damaged"):
        load_identity(path)
    path.write_text("not json")
    with pytest.raises(FailedPrecondition, match="cannot read node identity"):
        load_identity(path)


async def test_identity_of_another_node_is_refused(tmp_path: Path, exchange) -> None:
    exchange.answers = [(200, exchange.ok())]
    config = _config(tmp_path, exchange.url)
    await ensure_identity(config, tmp_path / "identity.json")
    other = node_config(tmp_path, node_id="node-z", ctrl_url=exchange.url)
    with pytest.raises(FailedPrecondition, match="belongs to node 'node-a'"):
        await ensure_identity(other, tmp_path / "identity.json")
