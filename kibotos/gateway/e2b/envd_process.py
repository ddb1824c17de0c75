"""envd's ``process.Process`` service over the data plane's exec (`ProcessTable`).

``Start`` runs ``[cmd, *args]`` as the call's user (in its home without a ``cwd``,
as envd does) with the sandbox's ``envVars`` under the call's
``envs``, streams ``start``, then ``data`` (stdout, stderr, or pty), then ``end``
(exit code, ``exited``, status), with ``keepalive`` events when quiet for the
``Keepalive-Ping-Interval`` the client asked for.  ``Connect`` attaches to a running
process, ``List`` shows them, ``SendInput``, ``CloseStdin``, ``SendSignal`` (SIGTERM,
SIGKILL) and ``Update`` (a pty's size) act on one.  ``StreamInput`` (a client stream)
is not served: the SDK uses ``SendInput``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import trio
from google.protobuf.message import Message

from kibotos.core.errors import InvalidArgument, KibotosError
from kibotos.dataplane.clients.client import Output
from kibotos.dataplane.clients.exec_wire import ExecRequest
from kibotos.gateway.e2b.processes import Event, Process, ProcessTable
from kibotos.gateway.e2b.third_party.envd import process_pb2 as pb
from kibotos.guest import ExitStatus

#: Keepalive events when a stream is quiet this long (envd's default; clients ask
#: for less with ``Keepalive-Ping-Interval``).
DEFAULT_KEEPALIVE = 90.0
_SIGNALS = {pb.SIGNAL_SIGKILL: "KILL", pb.SIGNAL_SIGTERM: "TERM"}


def _status(exit: ExitStatus) -> str:
    if exit.exit_code is not None:
        return f"exit status {exit.exit_code}"
    return f"signal: {(exit.signal_name or str(exit.signal)).lower()}"


def _event(event: Event, pty: bool) -> pb.ProcessEvent:
    if isinstance(event, KibotosError):
        raise event
    if isinstance(event, Output):
        if pty:
            return pb.ProcessEvent(data=pb.ProcessEvent.DataEvent(pty=event.data))
        if event.stream == 1:
            return pb.ProcessEvent(data=pb.ProcessEvent.DataEvent(stdout=event.data))
        return pb.ProcessEvent(data=pb.ProcessEvent.DataEvent(stderr=event.data))
    return pb.ProcessEvent(end=pb.ProcessEvent.EndEvent(
        exit_code=event.returncode, exited=event.exit_code is not None,
        status=_status(event)))


async def _follow(proc: Process, events: trio.MemoryReceiveChannel[Event], keepalive: float,
                  pty: bool) -> AsyncIterator[pb.ProcessEvent]:
    yield pb.ProcessEvent(start=pb.ProcessEvent.StartEvent(pid=proc.pid))
    async with events:
        while True:
            with trio.move_on_after(keepalive) as quiet:
                try:
                    event = await events.receive()
                except trio.EndOfChannel:
                    return
            if quiet.cancelled_caught:
                yield pb.ProcessEvent(keepalive=pb.ProcessEvent.KeepAlive())
                continue
            yield _event(event, pty)
            if isinstance(event, ExitStatus):
                return


def _selector(message: Any) -> dict[str, Any]:
    which = message.process.WhichOneof("selector")
    if which == "pid":
        return {"pid": message.process.pid}
    if which == "tag":
        return {"tag": message.process.tag}
    raise InvalidArgument("process: give a pid or a tag")


class ProcessService:
    def __init__(self, table: ProcessTable) -> None:
        self.table = table

    async def start(self, request: pb.StartRequest, call: Any) -> AsyncIterator[Message]:
        config = request.process
        if not config.cmd:
            raise InvalidArgument("process.cmd must not be empty")
        pty = request.HasField("pty")
        env = {**call.env_vars, **dict(config.envs)}
        exec_request = ExecRequest(
            argv=(config.cmd, *config.args), env=env,
            cwd=config.cwd if config.HasField("cwd") else None, tty=pty,
            rows=request.pty.size.rows or 24 if pty else 24,
            cols=request.pty.size.cols or 80 if pty else 80, user=call.user)
        session = await call.session()
        proc, events = await self.table.start(
            call.sandbox_id, session.url, session.credential, exec_request,
            tag=request.tag if request.HasField("tag") else None,
            keep_stdin=pty or (request.HasField("stdin") and request.stdin),
            ssl_context=session.tls)
        async for event in _follow(proc, events, call.keepalive, pty):
            yield pb.StartResponse(event=event)

    async def connect(self, request: pb.ConnectRequest, call: Any) -> AsyncIterator[Message]:
        proc = self.table.find(call.sandbox_id, **_selector(request))
        async for event in _follow(proc, proc.subscribe(), call.keepalive, False):
            yield pb.ConnectResponse(event=event)

    async def list(self, request: pb.ListRequest, call: Any) -> Message:
        return pb.ListResponse(processes=[
            pb.ProcessInfo(pid=p.pid, tag=p.tag, config=pb.ProcessConfig(
                cmd=p.argv[0], args=list(p.argv[1:]), envs=p.env, cwd=p.cwd))
            for p in self.table.of(call.sandbox_id)])

    async def send_input(self, request: pb.SendInputRequest, call: Any) -> Message:
        proc = self.table.find(call.sandbox_id, **_selector(request))
        which = request.input.WhichOneof("input")
        if which is not None:
            await proc.client.send_stdin(getattr(request.input, which))
        return pb.SendInputResponse()

    async def close_stdin(self, request: pb.CloseStdinRequest, call: Any) -> Message:
        proc = self.table.find(call.sandbox_id, **_selector(request))
        await proc.client.close_stdin()
        return pb.CloseStdinResponse()

    async def send_signal(self, request: pb.SendSignalRequest, call: Any) -> Message:
        proc = self.table.find(call.sandbox_id, **_selector(request))
        name = _SIGNALS.get(request.signal)
        if name is None:
            raise InvalidArgument(f"signal {request.signal} is not SIGTERM or SIGKILL")
        await proc.client.signal(name)
        return pb.SendSignalResponse()

    async def update(self, request: pb.UpdateRequest, call: Any) -> Message:
        proc = self.table.find(call.sandbox_id, **_selector(request))
        if request.HasField("pty"):
            await proc.client.resize(request.pty.size.rows or 24, request.pty.size.cols or 80)
        return pb.UpdateResponse()
