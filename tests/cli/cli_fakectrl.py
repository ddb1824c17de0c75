"""A real HTTP server on loopback that stands in for ctrl and records every request.

It answers from canned responses (the last one repeats), so CLI tests can check what
was sent, and that nothing was sent on bad input, without a ctrl process.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

Response = tuple[int, Any]
Responder = Callable[["Recorded"], Response]


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any


@dataclass
class FakeCtrl:
    url: str = ""
    requests: list[Recorded] = field(default_factory=list)
    routes: dict[tuple[str, str], list[Response | Responder]] = field(default_factory=dict)
    #: Requests whose connection is closed without an answer (to exercise retries).
    drop_next: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def route(self, method: str, path: str, *responses: Response | Responder) -> None:
        self.routes[(method, path)] = list(responses)

    def answer(self, rec: Recorded) -> Response | None:
        with self.lock:
            self.requests.append(rec)
            if self.drop_next:
                self.drop_next -= 1
                return None
            queue = self.routes.get((rec.method, rec.path))
            if not queue:
                return 404, {"error": {"code": "not_found",
                                       "message": f"no route {rec.method} {rec.path}"}}
            item = queue.pop(0) if len(queue) > 1 else queue[0]
        return item(rec) if callable(item) else item

    def sent(self, method: str | None = None, path: str | None = None) -> list[Recorded]:
        return [r for r in self.requests
                if (method is None or r.method == method) and (path is None or r.path == path)]


def _handler(fake: FakeCtrl) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _serve(self) -> None:
            parts = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            rec = Recorded(
                method=self.command,
                path=parts.path,
                query={k: v[-1] for k, v in parse_qs(parts.query).items()},
                headers={k.lower(): v for k, v in self.headers.items()},
                body=json.loads(raw) if raw else None,
            )
            answer = fake.answer(rec)
            if answer is None:
                self.close_connection = True
                self.connection.close()
                return
            status, body = answer
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = _serve

    return Handler


class FakeCtrlServer:
    def __init__(self) -> None:
        self.fake = FakeCtrl()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self.fake))
        self.server.daemon_threads = True
        host, port = self.server.server_address[:2]
        self.fake.url = f"http://{host}:{port}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                       daemon=True)

    def __enter__(self) -> FakeCtrl:
        self.thread.start()
        return self.fake

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)
