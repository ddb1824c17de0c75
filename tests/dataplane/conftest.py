"""The data-plane tests' node (`dp_harness.Node`): fresh directories under /tmp (short
socket paths) and ctrl's key, kept across the node restarts a test plays; every unit
it started is stopped at the end."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from dp_harness import Node, free_port

from kibotos.core.credentials import SigningKey


@pytest.fixture
def node() -> Iterator[Node]:
    base = Path(tempfile.mkdtemp(prefix="kdp-", dir="/tmp"))  # short socket paths
    (base / "state").mkdir()
    n = Node(base, f"127.0.0.1:{free_port()}", SigningKey.generate())
    try:
        yield n
    finally:
        async def stop_all() -> None:
            sup = n.supervisor()
            for info in await sup.list(""):
                await sup.stop(info.name, timeout=5)

        trio.run(stop_all)
        shutil.rmtree(base, ignore_errors=True)
