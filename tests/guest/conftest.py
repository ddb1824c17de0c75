"""Fixtures: a real agent subprocess per test, and a client connected to it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from guest_harness import AgentProcess, connected

from kibotos.guest import GuestChannel


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[AgentProcess]:
    proc = AgentProcess(tmp_path)
    yield proc
    proc.stop()
    # An unexpected exception in a handler is logged with its traceback: none may occur.
    assert "Traceback" not in proc.log_text(), proc.log_text()


@pytest.fixture
async def guest(agent: AgentProcess) -> AsyncIterator[GuestChannel]:
    async with connected(agent) as channel:
        yield channel
