"""envd's directory watches over the data plane's watch endpoint (``GET
/v1/files/watch``, the guest's inotify): ``WatchDir`` (a server stream, what the async
SDK uses) and its polling form ``CreateWatcher`` / ``GetWatcherEvents`` /
``RemoveWatcher`` (what the sync SDK's ``files.watch_dir`` uses).

Both answer only once the guest's watch is set, so a file written after
``watch_dir()`` returns is always seen.  Memory is bounded at every hop: the guest
sends events under credit (its kernel queue takes the rest, and overflows into an
``overflow`` line), a stream goes only as fast as its client reads, and a polled
watcher holds at most `WATCHER_BUFFER` unfetched events.  Either kind of loss ends the
watch with ``resource_exhausted`` naming it, never a silent gap.  ``include_entry``
(envd 0.6.3) is not served; the gateway announces 0.5.7, so the SDK never asks.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import trio
from google.protobuf.message import Message

from kibotos.core.errors import (
    InvalidArgument,
    KibotosError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kibotos.dataplane.clients.files_client import FilesClient
from kibotos.gateway.e2b.connect_rpc import Unimplemented
from kibotos.gateway.e2b.third_party.envd import filesystem_pb2 as pb

log = logging.getLogger("kibotos.gateway.e2b")

#: Unfetched events a polled watcher holds before it fails (the client polls too slowly).
WATCHER_BUFFER = 4096
#: Polled watchers a sandbox may have at once (each holds a data-plane connection).
MAX_WATCHERS = 64
#: How long an ended watcher (its sandbox gone, say) waits for its client to fetch the
#: rest and the reason, before it is dropped unasked.
ENDED_RETENTION = 600.0
#: The longest line the data plane may send (an event is a name and a kind).
MAX_LINE = 64 * 1024
_KINDS = {"create": pb.EVENT_TYPE_CREATE, "write": pb.EVENT_TYPE_WRITE,
          "remove": pb.EVENT_TYPE_REMOVE, "rename": pb.EVENT_TYPE_RENAME,
          "chmod": pb.EVENT_TYPE_CHMOD}


def _event(line: bytes, path: str) -> pb.FilesystemEvent:
    try:
        body = json.loads(line)
    except ValueError:
        raise Unavailable(f"the data plane sent a watch line that is not JSON: "
                          f"{line[:100]!r}") from None
    kind = body.get("type") if isinstance(body, dict) else None
    if kind == "overflow":
        raise ResourceExhausted(f"the watch of {path} lost events: it was read too slowly "
                                "and the guest's inotify queue overflowed")
    name = body.get("name") if isinstance(body, dict) else None
    if kind not in _KINDS or not isinstance(name, str):
        raise Unavailable(f"the data plane sent an unknown watch event: {line[:100]!r}")
    return pb.FilesystemEvent(name=name, type=_KINDS[kind])


class _Watch:
    """One open watch: the data plane's answer is in, the events follow."""

    def __init__(self, chunks: AsyncIterator[bytes], path: str) -> None:
        self._chunks = chunks
        self._path = path
        self._pending = bytearray()

    async def next(self) -> pb.FilesystemEvent | None:
        """The next event; None once the watched directory is gone."""
        while b"\n" not in self._pending:
            if len(self._pending) > MAX_LINE:
                raise Unavailable(f"the data plane sent a watch line over {MAX_LINE} bytes")
            try:
                chunk = await anext(self._chunks)
            except StopAsyncIteration:
                return None
            self._pending += chunk
        line, _, rest = bytes(self._pending).partition(b"\n")
        self._pending[:] = rest
        return _event(line, self._path)


def _check(request: pb.WatchDirRequest | pb.CreateWatcherRequest) -> None:
    if not request.path.startswith("/"):
        raise InvalidArgument(f"path must be an absolute path, got {request.path!r}")
    if request.include_entry:
        raise Unimplemented("include_entry (envd 0.6.3) is not served by this kibotos "
                            "gateway")


async def _open(call: Any, request: pb.WatchDirRequest | pb.CreateWatcherRequest
                ) -> tuple[FilesClient, dict[str, str]]:
    _check(request)
    session = await call.session()
    return FilesClient(session.url, session.credential, ssl_context=session.tls), {
        "recursive": "true" if request.recursive else "false"}


@dataclass
class Watcher:
    sandbox_id: str
    watcher_id: str
    path: str
    events: list[pb.FilesystemEvent] = field(default_factory=list)
    error: KibotosError | None = None
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


class WatcherTable:
    """The polled watchers, each a task of the gateway's nursery holding its watch."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._all: dict[str, Watcher] = {}

    def of(self, sandbox_id: str) -> list[Watcher]:
        return [w for w in self._all.values() if w.sandbox_id == sandbox_id]

    async def create(self, request: pb.CreateWatcherRequest, call: Any) -> Watcher:
        if len(self.of(call.sandbox_id)) >= MAX_WATCHERS:
            raise ResourceExhausted(f"sandbox {call.sandbox_id} has {MAX_WATCHERS} watchers "
                                    "already: remove one first")
        files, params = await _open(call, request)
        watcher = Watcher(call.sandbox_id, secrets.token_hex(16), request.path)
        await self._nursery.start(self._run, watcher, files, params)
        return watcher

    async def _run(self, watcher: Watcher, files: FilesClient, params: dict[str, str],
                   task_status: trio.TaskStatus[None]) -> None:
        running = False
        with watcher.scope:
            try:
                async with files.download("watch", watcher.path, **params) as down:
                    self._all[watcher.watcher_id] = watcher
                    running = True
                    task_status.started()
                    watch = _Watch(down.chunks(), watcher.path)
                    while (event := await watch.next()) is not None:
                        if len(watcher.events) >= WATCHER_BUFFER:
                            raise ResourceExhausted(
                                f"watcher {watcher.watcher_id} holds {WATCHER_BUFFER} "
                                "events nobody fetched: it was stopped, later events "
                                "are lost")
                        watcher.events.append(event)
            except KibotosError as exc:
                if not running:
                    raise  # to CreateWatcher, through nursery.start
                log.info("sandbox %s: watcher %s ended: %s", watcher.sandbox_id,
                         watcher.watcher_id, exc.message)
                watcher.error = exc
            # Ended (its sandbox gone, its directory removed, an overflow): kept for
            # the client to fetch what is left and why, but not for ever.
            await trio.sleep(ENDED_RETENTION)
            if self._all.get(watcher.watcher_id) is watcher:
                del self._all[watcher.watcher_id]

    def _find(self, sandbox_id: str, watcher_id: str) -> Watcher:
        watcher = self._all.get(watcher_id)
        if watcher is None or watcher.sandbox_id != sandbox_id:
            raise NotFound(f"watcher {watcher_id!r} not found")
        return watcher

    def take(self, sandbox_id: str, watcher_id: str) -> list[pb.FilesystemEvent]:
        """The events since the last take; a watcher that failed answers its error
        (once its events were taken) and is gone."""
        watcher = self._find(sandbox_id, watcher_id)
        events, watcher.events = watcher.events, []
        if not events and watcher.error is not None:
            self.remove(sandbox_id, watcher_id)
            raise watcher.error
        return events

    def remove(self, sandbox_id: str, watcher_id: str) -> None:
        watcher = self._find(sandbox_id, watcher_id)
        watcher.scope.cancel()
        del self._all[watcher_id]


class WatchService:
    def __init__(self, table: WatcherTable) -> None:
        self.table = table

    async def watch_dir(self, request: pb.WatchDirRequest, call: Any
                        ) -> AsyncIterator[Message]:
        files, params = await _open(call, request)
        async with files.download("watch", request.path, **params) as down:
            yield pb.WatchDirResponse(start=pb.WatchDirResponse.StartEvent())
            watch = _Watch(down.chunks(), request.path)
            while True:
                with trio.move_on_after(call.keepalive) as quiet:
                    event = await watch.next()
                if quiet.cancelled_caught:
                    yield pb.WatchDirResponse(keepalive=pb.WatchDirResponse.KeepAlive())
                    continue
                if event is None:
                    return
                yield pb.WatchDirResponse(filesystem=event)

    async def create_watcher(self, request: pb.CreateWatcherRequest, call: Any) -> Message:
        watcher = await self.table.create(request, call)
        return pb.CreateWatcherResponse(watcher_id=watcher.watcher_id)

    async def get_watcher_events(self, request: pb.GetWatcherEventsRequest, call: Any
                                 ) -> Message:
        return pb.GetWatcherEventsResponse(
            events=self.table.take(call.sandbox_id, request.watcher_id))

    async def remove_watcher(self, request: pb.RemoveWatcherRequest, call: Any) -> Message:
        self.table.remove(call.sandbox_id, request.watcher_id)
        return pb.RemoveWatcherResponse()
