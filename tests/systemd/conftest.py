"""Fixtures of the systemd tests: a real user systemd (`usersystemd.UserSystemd`), the
``systemd`` supervisor on its bus, and a raw D-Bus reader (systemd_helpers.py).  A test
that takes ``user_systemd`` must carry the ``systemd`` marker; the fixture fails one
that does not, so selecting by marker stays true.

Without what the user manager needs (root, systemd, dbus-user-session) the tests that
use it are skipped on a developer's machine but fail under CI (``CI=true``), where
`.ci/run` installs packaging/apt-test-deps.txt: a green CI must not hide them.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator, Iterator

import pytest
from systemd_helpers import Raw, new_supervisor
from usersystemd import UserSystemd, why_unusable

from kibotos.backends import Supervisor
from kibotos.testing.waiting import wait_until_sync

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
#: How long `netns_holder` waits for ``unshare --net`` to take effect.
NETNS_DEADLINE = 60


@pytest.fixture
def user_systemd(request: pytest.FixtureRequest) -> Iterator[UserSystemd]:
    if request.node.get_closest_marker("systemd") is None:
        pytest.fail("a test that starts a user systemd must be marked systemd (so "
                    "-m 'not systemd' leaves it out)")
    why = why_unusable()
    if why is not None:
        if IN_CI:
            pytest.fail(f"user systemd unusable: {why}; .ci/run must install it")
        pytest.skip(why)
    manager = UserSystemd()
    try:
        yield manager
    finally:
        manager.close()


@pytest.fixture
async def sup(user_systemd: UserSystemd) -> AsyncIterator[Supervisor]:
    supervisor = new_supervisor(user_systemd)
    yield supervisor
    for info in await supervisor.list(""):
        await supervisor.stop(info.name, timeout=1)


@pytest.fixture
def raw(user_systemd: UserSystemd) -> Raw:
    return Raw(user_systemd.bus)


@pytest.fixture
def netns_holder() -> Iterator[subprocess.Popen[bytes]]:
    """A process in a fresh network namespace (a stand-in for the one the node makes).
    Its ``/proc/<pid>/ns/net`` can be opened from any mount namespace (the user manager
    has a private one)."""
    proc = subprocess.Popen(["unshare", "--net", "sleep", "1000"])
    try:
        own = os.stat("/proc/self/ns/net").st_ino
        wait_until_sync(lambda: os.stat(f"/proc/{proc.pid}/ns/net").st_ino != own,
                        "unshare --net to take effect", timeout=NETNS_DEADLINE,
                        interval=0.02)
        yield proc
    finally:
        proc.kill()
        proc.wait()
