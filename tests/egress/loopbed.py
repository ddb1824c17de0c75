"""What the egress process's tests on loopback share: a real SOCKS5 server
(Debian's microsocks, which checks username and password; else a skip, or a failure
under ``CI=true``) and small TCP and DNS servers of the test's own.  Every server stops
by itself: microsocks runs under ``timeout``, the others on daemon threads with a
deadline."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
LIFETIME = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Microsocks:
    def __init__(self, port: int, username: str | None, password: str | None) -> None:
        binary = shutil.which("microsocks")
        if binary is None:
            msg = "microsocks is missing (packaging/apt-test-deps.txt)"
            if IN_CI:
                pytest.fail(msg)
            pytest.skip(msg)
        argv = ["timeout", str(int(LIFETIME)), binary, "-i", "127.0.0.1", "-p", str(port)]
        if username is not None and password is not None:
            argv += ["-u", username, "-P", password]
        self.port = port
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", port), timeout=1):
                return
            time.sleep(0.05)
        self.stop()
        raise AssertionError("microsocks did not listen")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@pytest.fixture
def microsocks() -> Iterator[Callable[..., Microsocks]]:
    started: list[Microsocks] = []

    def start(username: str | None = "alice", password: str | None = "s3cret",
              port: int | None = None) -> Microsocks:
        server = Microsocks(port or free_port(), username, password)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


class TcpServer:
    """A threaded TCP server on loopback: `handle(conn)` per connection."""

    def __init__(self, handle: Callable[[socket.socket], None]) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = int(self.sock.getsockname()[1])
        self.accepted = 0
        self._stop = threading.Event()
        self._deadline = time.monotonic() + LIFETIME
        self._thread = threading.Thread(target=self._loop, args=(handle,), daemon=True)
        self._thread.start()

    def _loop(self, handle: Callable[[socket.socket], None]) -> None:
        with self.sock:
            while not self._stop.is_set() and time.monotonic() < self._deadline:
                try:
                    conn, _ = self.sock.accept()
                except TimeoutError:
                    continue
                self.accepted += 1
                conn.settimeout(10)
                threading.Thread(target=self._one, args=(conn, handle), daemon=True).start()

    @staticmethod
    def _one(conn: socket.socket, handle: Callable[[socket.socket], None]) -> None:
        with conn, contextlib.suppress(OSError):
            handle(conn)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def echo(conn: socket.socket) -> None:
    while data := conn.recv(4096):
        conn.sendall(data)


def banner(conn: socket.socket) -> None:
    """A destination that speaks first (SSH, SMTP …), then echoes."""
    conn.sendall(b"HELLO FROM THE DESTINATION\r\n")
    echo(conn)


@pytest.fixture
def tcp_server() -> Iterator[Callable[[Callable[[socket.socket], None]], TcpServer]]:
    started: list[TcpServer] = []

    def start(handle: Callable[[socket.socket], None] = echo) -> TcpServer:
        server = TcpServer(handle)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
