"""The ``direct`` supervisor applies ``NetworkNamespacePath`` as systemd does: the unit's
processes are born in that namespace (`kibotos_direct.confine` joins it with ``setns``
between fork and exec); a namespace that cannot be joined fails the start, naming it
(the launcher checks it before the fork), and so does a file that is no namespace."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from kibotos_direct.supervisor import DirectSupervisor

from kibotos.backends import UnitSpec
from kibotos.core.errors import FailedPrecondition

pytestmark = pytest.mark.root


@pytest.fixture
def holder() -> Iterator[subprocess.Popen[bytes]]:
    """A process in a namespace of its own, which a unit can join by its path."""
    proc = subprocess.Popen(["unshare", "--net", "sleep", "300"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


async def test_a_unit_runs_in_its_network_namespace(tmp_path: Path,
                                                    holder: subprocess.Popen[bytes]) -> None:
    netns = f"/proc/{holder.pid}/ns/net"
    while os.stat(netns).st_ino == os.stat("/proc/self/ns/net").st_ino:  # unshare not done
        await trio.sleep(0.01)
    sup = DirectSupervisor({"state_dir": str(tmp_path)})
    info = await sup.start(UnitSpec("ns-unit.service", ["sleep", "300"],
                                    properties={"NetworkNamespacePath": netns}))
    try:
        assert info.netns_inode == os.stat(netns).st_ino
        assert info.netns_inode != os.stat("/proc/self/ns/net").st_ino
    finally:
        await sup.stop("ns-unit.service", timeout=5)


async def test_a_namespace_that_cannot_be_joined_fails_the_start(tmp_path: Path) -> None:
    sup = DirectSupervisor({"state_dir": str(tmp_path)})
    with pytest.raises(FailedPrecondition, match="NetworkNamespacePath=/nonexistent/ns"):
        await sup.start(UnitSpec("ns-unit.service", ["sleep", "300"],
                                 properties={"NetworkNamespacePath": "/nonexistent/ns"}))
    assert await sup.describe("ns-unit.service") is None


async def test_a_file_that_is_no_network_namespace_fails_the_start(tmp_path: Path) -> None:
    sup = DirectSupervisor({"state_dir": str(tmp_path)})
    other = tmp_path / "not-a-namespace"
    other.write_text("")
    with pytest.raises(FailedPrecondition, match="not a network namespace"):
        await sup.start(UnitSpec("ns-unit.service", ["sleep", "300"],
                                 properties={"NetworkNamespacePath": str(other)}))
    with pytest.raises(FailedPrecondition, match="not a network namespace"):
        await sup.start(UnitSpec("ns-unit.service", ["sleep", "300"],
                                 properties={"NetworkNamespacePath": "/proc/self/ns/uts"}))
    assert await sup.describe("ns-unit.service") is None
