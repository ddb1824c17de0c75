"""ctrl's egress credentials endpoint as a small HTTP server on loopback, for the node's
tests: ``GET /v1/egresses/{name}/credentials?revision=N`` with the node's bearer
credential answers ``{"result": {name, revision, address, username, password}}``, as
ctrl does (its envelope, which an earlier fake left out: the node read ctrl's real
answer as malformed, first seen by tests/gateway/test_e2b_sdk_qemu.py), 401 without
the credential, 404 for a revision it
does not have, in ctrl's error body.  It counts the requests, so a test can show that a
restarted node did not ask.

    with FakeCredentials("node-secret", {("corp", 1): ("alice", "s3cret")}) as ctrl:
        client = CredentialClient(ctrl.url, "node-secret")

It serves on a daemon thread and stops by itself after `lifetime` seconds at the latest.
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

_PATH = re.compile(r"/v1/egresses/([^/]+)/credentials")


class FakeCredentials:
    def __init__(self, node_credential: str,
                 revisions: dict[tuple[str, int], tuple[str | None, str | None]], *,
                 lifetime: float = 300.0, address: str = "socks.test:1080") -> None:
        self.node_credential = node_credential
        self.address = address
        self.revisions = dict(revisions)
        self.requests: list[tuple[str, int | None]] = []
        self.lifetime = lifetime
        #: A test's malformed answer, sent as JSON as ctrl's ``result``.
        self.answer_override: Any = None
        self._stopped = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                fake._get(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        deadline = time.monotonic() + self.lifetime
        self.server.timeout = 0.2
        while time.monotonic() < deadline and not self._stopped.is_set():
            self.server.handle_request()

    def _get(self, handler: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(handler.path)
        match = _PATH.fullmatch(parts.path)
        revision_text = parse_qs(parts.query).get("revision", [""])[0]
        revision = int(revision_text) if revision_text.isdigit() else None
        name = match.group(1) if match else ""
        self.requests.append((name, revision))
        if handler.headers.get("Authorization") != f"Bearer {self.node_credential}":
            return self._send(handler, 401, {"error": {
                "code": "unauthenticated", "message": "a node credential is required"}})
        if match is None or revision is None or (name, revision) not in self.revisions:
            return self._send(handler, 404, {"error": {
                "code": "not_found", "message": f"egress {name} has no revision "
                                                f"{revision_text}"}})
        if self.answer_override is not None:
            return self._send(handler, 200, {"result": self.answer_override})
        username, password = self.revisions[(name, revision)]
        # ctrl's envelope and fields (EgressCredentialsOut), the address included
        return self._send(handler, 200, {"result": {
            "name": name, "revision": revision, "address": self.address,
            "username": username, "password": password}})

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def __enter__(self) -> FakeCredentials:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped.set()
        self._thread.join(5)
        self.server.server_close()
