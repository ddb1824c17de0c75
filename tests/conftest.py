"""What every test directory shares: the markers' rules and a real PostgreSQL server.

Markers (declared in pyproject.toml):

* ``slow``: end-to-end or long; ``make test-fast`` leaves them out.
* ``root``: needs root; skipped for other users.
* ``postgres``: runs against a real PostgreSQL server that this file starts once per
  test session from Debian's ``postgresql`` package.  Without the package the tests are
  skipped on a developer's machine, but fail under CI (``CI=true``), where `.ci/run`
  installs it: a green CI must not hide a skipped store backend.

Fixtures: ``postgres_server`` (session; the server's admin URL) and ``postgres_url``
(one fresh, empty database per test, dropped afterwards); ``autojump_clock`` replaces
pytest-trio's with one that does not jump while a worker thread runs.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kibotos.testing.clock import ThreadAwareClock

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# The processes tests start are started by hand, not as units of whatever service manager
# runs the test session (a CI runner may be a systemd service): drop what systemd sets for
# its own units, or a node would check itself against the runner's unit.
for _variable in ("INVOCATION_ID", "NOTIFY_SOCKET", "JOURNAL_STREAM", "WATCHDOG_USEC",
                  "WATCHDOG_PID", "MAINPID"):
    os.environ.pop(_variable, None)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("root") is not None and os.geteuid() != 0:
        pytest.skip("needs root")


# ---------------------------------------------------------------------------- PostgreSQL


def _pg_bindir() -> Path | None:
    """The newest server installed by Debian's postgresql package, if any."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(Path(p).parent.parent.name))
    return Path(found[-1]).parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _PostgresServer:
    """One throwaway cluster: initdb into a temporary directory, pg_ctl start/stop.

    PostgreSQL refuses to run as root, so as root the server runs as the ``postgres``
    user the package creates, in a directory handed to that user.
    """

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.dir = Path(tempfile.mkdtemp(prefix="kibotos-pg-"))
        self.data = self.dir / "data"
        self.port = _free_port()
        self.prefix: list[str] = []
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
            self.prefix = ["runuser", "-u", "postgres", "--"]

    def _run(self, *argv: str) -> None:
        proc = subprocess.run([*self.prefix, *argv], capture_output=True, text=True,
                              timeout=120, check=False, cwd=self.dir)
        if proc.returncode != 0:
            log = self.dir / "server.log"
            extra = log.read_text()[-3000:] if log.exists() else ""
            raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n"
                               f"{proc.stdout}{proc.stderr}{extra}")

    def start(self) -> None:
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres",
                  "-A", "trust", "-E", "UTF8", "--no-sync")
        opts = (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 "
                "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
                "-c max_connections=200")
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l",
                  str(self.dir / "server.log"), "-o", opts, "-w", "-t", "60", "start")

    def stop(self) -> None:
        try:
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate",
                      "-w", "stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """A PostgreSQL server for this test session; yields its admin database URL."""
    bindir = _pg_bindir()
    if bindir is None:
        message = "PostgreSQL is not installed (apt-get install postgresql)"
        if IN_CI:
            pytest.fail(message + "; .ci/run must install it")
        pytest.skip(message)
    server = _PostgresServer(bindir)
    server.start()
    try:
        yield server.url()
    finally:
        server.stop()


@pytest.fixture
def postgres_url(postgres_server: str) -> Iterator[str]:
    """A fresh, empty database on the session's server; dropped after the test."""
    import psycopg

    name = f"t_{os.getpid()}_{next(_db_counter)}"
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield postgres_server.rsplit("/", 1)[0] + f"/{name}"
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _counter() -> Iterator[int]:
    n = 0
    while True:
        n += 1
        yield n


_db_counter = _counter()


# ---------------------------------------------------------------------------- clocks


@pytest.fixture
def autojump_clock() -> ThreadAwareClock:
    """pytest-trio's ``autojump_clock``, made safe for code that runs worker threads.

    pytest-trio's own is ``MockClock(autojump_threshold=0)``, which jumps to the next
    deadline while ctrl's store runs a transaction in a thread (trio issue #456); this
    one (`kibotos.testing.clock.ThreadAwareClock`) holds the jump until the thread is
    back.  Take it in tests whose every wait is inside trio: in-process ctrl
    (``httpx.ASGITransport``, the ``inprocess_ctrl`` fixture), in-memory streams, trio
    sleeps and timeouts; not with subprocesses or real sockets, which it cannot see."""
    return ThreadAwareClock()
