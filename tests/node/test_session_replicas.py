"""``[node] ctrl_url`` listing several ctrl replicas (docs/replicas.md): the control
session goes to the next when one does not answer or ends the session, the config
refuses a list that could not work, and `CtrlUrls` moves on once per failure."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import trio
from node_helpers import FakeCtrl, RecordingInstances, node_config, store_identity

from kibotos.config import MAX_CTRL_URLS, NodeConfig
from kibotos.core.errors import InvalidArgument
from kibotos.node.host.clock import NodeClock
from kibotos.node.host.usage import UsageSampler
from kibotos.node.session.control import ControlSession, SessionTiming
from kibotos.node.session.ctrl_http import CtrlUrls
from kibotos.node.session.report import ReportBoard

FAST = SessionTiming(ping_interval=0.05, silence_timeout=30.0, welcome_timeout=30.0,
                     slow_retry=60.0, backoff_initial=0.02, backoff_cap=0.1)


def _config(tmp_path: Path, urls: str | list[str]) -> NodeConfig:
    return node_config(tmp_path, ctrl_url=urls)


def _dead_url() -> str:
    """A loopback port nobody listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_ctrl_urls_move_on_once_per_failure() -> None:
    urls = CtrlUrls(["http://a:1/", "http://b:1", "http://c:1"])
    assert urls.current == "http://a:1"
    urls.failed("http://a:1")
    assert urls.current == "http://b:1"
    urls.failed("http://a:1")  # a late failure of the old one: no second step
    assert urls.current == "http://b:1"
    urls.failed("http://b:1")
    urls.failed("http://c:1")
    assert urls.current == "http://a:1"  # round again
    one = CtrlUrls(["http://a:1"])
    one.failed("http://a:1")
    assert one.current == "http://a:1"
    with pytest.raises(ValueError, match="no ctrl URL"):
        CtrlUrls([])


def test_one_url_or_a_list(tmp_path: Path) -> None:
    assert _config(tmp_path, "http://127.0.0.1:7400/").node.ctrl_urls == (
        "http://127.0.0.1:7400",)
    assert _config(tmp_path, ["http://127.0.0.1:1", "http://localhost:2"]).node.ctrl_urls \
        == ("http://127.0.0.1:1", "http://localhost:2")


@pytest.mark.parametrize(("urls", "message"), [
    ([], "a list of 1 to"),
    ([f"http://127.0.0.1:{p}" for p in range(1, MAX_CTRL_URLS + 2)], "a list of 1 to"),
    (["http://127.0.0.1:1", "http://127.0.0.1:1/"], "lists a URL twice"),
    (["http://127.0.0.1:1", "http://ctrl.example:7400"], "must be https://"),
    (["http://127.0.0.1:1", "ftp://127.0.0.1:2"], "is not http"),
])
def test_a_list_that_cannot_work_is_refused(tmp_path: Path, urls: list[str],
                                            message: str) -> None:
    with pytest.raises(InvalidArgument, match=message) as info:
        _config(tmp_path, urls)
    assert "ctrl_url" in info.value.message


def _session(tmp_path: Path, urls: list[str]) -> ControlSession:
    config = _config(tmp_path, urls)
    identity = store_identity(config)
    manager = RecordingInstances()
    sampler = UsageSampler(config.host.proc_root, manager)
    return ControlSession(config, identity, 1, clock=NodeClock(config.testing.clock_skew_file),
                          sampler=sampler, board=ReportBoard(manager, sampler.tightness),
                          instances=manager, timing=FAST)


async def test_the_session_goes_to_the_next_replica_and_back(tmp_path: Path) -> None:
    """The first replica down: the session lands on the second.  The second ends it:
    the session tries the next (the first, still down) and comes back to the second."""
    dead = _dead_url()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            live = await nursery.start(FakeCtrl().serve)
            session = _session(tmp_path, [dead, live.ctrl_url])
            nursery.start_soon(session.run)
            first = await live.wait_conns(1)
            assert session.urls.current == live.ctrl_url
            await session.status.wait_until(lambda s: s.connected)
            await first.ws.aclose()  # the replica ends the session
            await live.wait_conns(2)
            assert session.urls.current == live.ctrl_url
            nursery.cancel_scope.cancel()
