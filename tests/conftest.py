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

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kibotos.dev import postgres
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


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """A PostgreSQL server for this test session; yields its admin database URL."""
    if postgres.bindir() is None:
        message = "PostgreSQL is not installed (apt-get install postgresql)"
        if IN_CI:
            pytest.fail(message + "; .ci/run must install it")
        pytest.skip(message)
    server = postgres.PostgresServer(Path(tempfile.mkdtemp(prefix="kibotos-pg-")), fast=True)
    try:
        server.start()
        yield server.url()
    finally:
        try:
            server.stop(immediate=True)
        finally:
            shutil.rmtree(server.dir, ignore_errors=True)


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
