"""The processes started through envd's ``Start``: each runs over one data-plane exec
held by a task of the gateway's nursery, so it outlives the request that started it
(as in envd: ``background=True`` commands, ``Connect``, ``List``, ``SendSignal``).

A process's events fan out to its subscribers (the ``Start`` stream, and any
``Connect`` streams), each a bounded channel: output is read from the data plane only
as fast as the slowest subscriber takes it, so memory stays bounded; with no subscriber
left, output is dropped, as envd does.  A process leaves the table when it exits.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import trio

from kibotos.core.errors import KibotosError, NotFound, Unavailable
from kibotos.dataplane.clients.client import ExecClient, Output, Started, open_exec
from kibotos.dataplane.clients.exec_wire import ExecRequest
from kibotos.guest import ExitStatus

log = logging.getLogger("kibotos.gateway.e2b")

#: Events a subscriber may be behind before the process waits for it.
SUBSCRIBER_BUFFER = 64

Event = Output | ExitStatus | KibotosError


@dataclass
class Process:
    sandbox_id: str
    pid: int
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str | None
    tag: str | None
    client: ExecClient
    subscribers: list[trio.MemorySendChannel[Event]] = field(default_factory=list)

    def subscribe(self) -> trio.MemoryReceiveChannel[Event]:
        send, receive = trio.open_memory_channel[Event](SUBSCRIBER_BUFFER)
        self.subscribers.append(send)
        return receive

    async def publish(self, event: Event) -> None:
        for channel in list(self.subscribers):
            try:
                await channel.send(event)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.subscribers.remove(channel)

    async def close_subscribers(self) -> None:
        for channel in self.subscribers:
            await channel.aclose()
        self.subscribers.clear()


class ProcessTable:
    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._all: dict[tuple[str, int], Process] = {}

    def of(self, sandbox_id: str) -> list[Process]:
        return [p for (sid, _), p in sorted(self._all.items()) if sid == sandbox_id]

    def find(self, sandbox_id: str, pid: int | None = None, tag: str | None = None
             ) -> Process:
        for proc in self.of(sandbox_id):
            if (pid is not None and proc.pid == pid) or (tag is not None and proc.tag == tag):
                return proc
        what = f"pid {pid}" if pid is not None else f"tag {tag!r}"
        raise NotFound(f"process with {what} not found")

    async def start(self, sandbox_id: str, url: str, credential: str, request: ExecRequest,
                    *, tag: str | None, keep_stdin: bool,
                    ssl_context: ssl.SSLContext | None = None
                    ) -> tuple[Process, trio.MemoryReceiveChannel[Event]]:
        """Start the process; returns it once it runs, subscribed to its events."""
        started: tuple[Process, trio.MemoryReceiveChannel[Event]] = await self._nursery.start(
            self._run, sandbox_id, url, credential, request, tag, keep_stdin, ssl_context)
        return started

    async def _run(self, sandbox_id: str, url: str, credential: str, request: ExecRequest,
                   tag: str | None, keep_stdin: bool, ssl_context: ssl.SSLContext | None,
                   task_status: trio.TaskStatus[tuple[Process, trio.MemoryReceiveChannel[Event]]]
                   ) -> None:
        running = False
        try:
            async with open_exec(url, credential, request, ssl_context=ssl_context) as client:
                first = await client.next_event()
                if not isinstance(first, Started):
                    raise Unavailable("the data plane sent no start for the process")
                proc = Process(sandbox_id, first.pid, request.argv, request.env,
                               request.cwd, tag, client)
                receive = proc.subscribe()
                if not keep_stdin:
                    await client.close_stdin()
                key = (sandbox_id, proc.pid)
                self._all[key] = proc
                running = True
                task_status.started((proc, receive))
                try:
                    await self._pump(proc)
                finally:
                    self._all.pop(key, None)
                    with trio.CancelScope(shield=True):
                        await proc.close_subscribers()
        except KibotosError as exc:
            if not running:
                raise  # to the Start call, through nursery.start
            log.info("sandbox %s: a process's exec ended badly: %s", sandbox_id,
                     exc.message)

    async def _pump(self, proc: Process) -> None:
        try:
            async for event in _events(proc.client):
                await proc.publish(event)
        except KibotosError as exc:
            log.info("sandbox %s: process %d lost: %s", proc.sandbox_id, proc.pid, exc.message)
            await proc.publish(exc)


async def _events(client: ExecClient) -> AsyncIterator[Output | ExitStatus]:
    while (event := await client.next_event()) is not None:
        if isinstance(event, Output | ExitStatus):
            yield event
