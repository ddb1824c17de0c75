"""The gateway's polled watchers (`envd_watch.WatcherTable`) against a data plane that
sends a watch's lines as fast as they are read (a loopback server, bounded in time):
the events come through in order, an unfetched backlog beyond the bound ends the
watcher with resource_exhausted instead of growing, the guest's overflow line does
the same, and a sandbox's number of watchers is bounded."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

import pytest
import trio

from kibotos.core.errors import NotFound, ResourceExhausted
from kibotos.gateway.e2b import envd_watch
from kibotos.gateway.e2b.ctrl_client import DataplaneSession
from kibotos.gateway.e2b.third_party.envd import filesystem_pb2 as pb
from kibotos.testing.waiting import wait_until

SID = "01m8t2krfny6fp0sctgh9wk6aa"
SERVER_LIFETIME = 60.0


@asynccontextmanager
async def watch_server(lines: list[bytes]) -> AsyncIterator[str]:
    """A data plane whose every watch answers `lines`, then stays open (as a watch
    does) until the client leaves or `SERVER_LIFETIME` passes."""

    async def serve(stream: trio.SocketStream) -> None:
        with trio.move_on_after(SERVER_LIFETIME), \
                contextlib.suppress(trio.BrokenResourceError):  # the client left
            async with stream:
                head = b""
                while b"\r\n\r\n" not in head:
                    head += await stream.receive_some(4096)
                await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson"
                                      b"\r\nTransfer-Encoding: chunked\r\n\r\n")
                for line in lines:
                    await stream.send_all(b"%x\r\n%s\r\n" % (len(line), line))
                while await stream.receive_some(4096):
                    pass

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        yield f"http://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


@dataclass
class Call:
    """What the envd app hands a handler: the sandbox and its data-plane session."""

    url: str
    sandbox_id: str = SID

    async def session(self) -> DataplaneSession:
        return DataplaneSession(self.url, "credential", trio.current_time() + 60)


def line(name: str) -> bytes:
    return b'{"name":"%s","type":"write"}\n' % name.encode()


async def test_events_in_order_then_a_backlog_beyond_the_bound_ends_the_watcher() -> None:
    total = envd_watch.WATCHER_BUFFER + 10
    async with watch_server([line(f"f{i}") for i in range(total)]) as url, \
            trio.open_nursery() as nursery:
        table = envd_watch.WatcherTable(nursery)
        watcher = await table.create(pb.CreateWatcherRequest(path="/w"), Call(url))
        await wait_until(lambda: watcher.error, "the watcher to overflow")
        events = table.take(SID, watcher.watcher_id)
        assert [e.name for e in events] == [f"f{i}" for i in range(envd_watch.WATCHER_BUFFER)]
        with pytest.raises(ResourceExhausted, match="nobody fetched"):
            table.take(SID, watcher.watcher_id)
        with pytest.raises(NotFound):  # an ended watcher is gone once it told why
            table.take(SID, watcher.watcher_id)
        nursery.cancel_scope.cancel()


async def test_the_guests_overflow_ends_the_watcher() -> None:
    async with watch_server([line("a"), b'{"type":"overflow"}\n']) as url, \
            trio.open_nursery() as nursery:
        table = envd_watch.WatcherTable(nursery)
        watcher = await table.create(pb.CreateWatcherRequest(path="/w"), Call(url))
        await wait_until(lambda: watcher.error, "the overflow to arrive")
        assert [e.name for e in table.take(SID, watcher.watcher_id)] == ["a"]
        with pytest.raises(ResourceExhausted, match="inotify queue overflowed"):
            table.take(SID, watcher.watcher_id)
        nursery.cancel_scope.cancel()


async def test_a_sandbox_has_a_bounded_number_of_watchers() -> None:
    async with watch_server([]) as url, trio.open_nursery() as nursery:
        table = envd_watch.WatcherTable(nursery)
        made = [await table.create(pb.CreateWatcherRequest(path="/w"), Call(url))
                for _ in range(envd_watch.MAX_WATCHERS)]
        with pytest.raises(ResourceExhausted, match="watchers already"):
            await table.create(pb.CreateWatcherRequest(path="/w"), Call(url))
        table.remove(SID, made[0].watcher_id)
        await table.create(pb.CreateWatcherRequest(path="/w"), Call(url))  # room again
        nursery.cancel_scope.cancel()


async def test_an_ended_watcher_is_dropped_when_nobody_fetches_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(envd_watch, "ENDED_RETENTION", 0.1)
    async with watch_server([b'{"type":"overflow"}\n']) as url, \
            trio.open_nursery() as nursery:
        table = envd_watch.WatcherTable(nursery)
        watcher = await table.create(pb.CreateWatcherRequest(path="/w"), Call(url))
        await wait_until(lambda: watcher.error, "the watcher to end")
        await wait_until(lambda: not table.of(SID) or None, "the ended watcher to be dropped")
        with pytest.raises(NotFound):
            table.take(SID, watcher.watcher_id)
        nursery.cancel_scope.cancel()
