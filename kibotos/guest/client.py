"""The host end of the guest protocol, over any trio stream.

::

    stream = await connect_unix_with_retry(sock_path, trio.current_time() + 30)
    async with open_guest_channel(stream) as guest:
        info = await guest.wait_hello(trio.current_time() + 30)
        await guest.configure(LaunchConfig(hostname="ws-1", dns=Dns(["10.0.0.2"])))
        proc = await guest.exec(["sh", "-c", "echo hi"])
        print(await proc.stdout.read_all(), await proc.wait())

One reader task decodes frames and routes them (responses to waiting requests, data to
streams, exits to processes); one writer task sends queued frames whole, so a caller's
cancellation can never leave half a frame on the wire.  The queue cannot grow without
bound: stdin data waits for the guest's credit, and control messages are one per call.

A connection is one session: on open the client sends the resync preamble and
``hello_request``, and the guest forgets whatever an earlier host had open.  To
reconnect, open a new channel on a new stream.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from kibotos.core.errors import (
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    KibotosError,
    PermissionDenied,
    Unavailable,
    error_of,
)
from kibotos.guest.files import Download, GuestFiles, Upload, require_capability, user_fields
from kibotos.guest.kibotos_guest.runtime.framing import (
    DEFAULT_WINDOW,
    KIND_CONTROL,
    RESYNC_PREAMBLE_SIZE,
    FrameDecoder,
    FrameError,
    encode_control,
)
from kibotos.guest.model import (
    ACCEPTED_PROTOCOL_VERSIONS,
    NETWORK_CAPABILITY,
    STOP_REASONS,
    ChannelStatistics,
    ConfigureResult,
    ExitStatus,
    GuestInfo,
    GuestProtocolUnsupported,
    GuestStopFailed,
    LaunchConfig,
    StopPrepareResult,
)
from kibotos.guest.ports import GuestPort, GuestPorts
from kibotos.guest.streams import (
    GuestInputStream,
    GuestOutputStream,
    GuestProcess,
    GuestProtocolViolation,
)

log = logging.getLogger(__name__)

#: How long stop_prepare waits past its deadline for the guest's sync and freeze.
STOP_SYNC_TIMEOUT = 30.0
#: How much the reader takes from the stream at a time: more than one largest frame
#: (24 + 256 KiB), so a full frame needs one read, not two.
RECEIVE_SIZE = 1 << 20


async def connect_unix_with_retry(path: str | os.PathLike[str], deadline: float, *,
                                  interval: float = 0.05) -> trio.SocketStream:
    """Connect to QEMU's chardev socket, retrying until `deadline` (trio time).

    The socket file exists before QEMU listens on it, so the first attempts may be
    refused; that is expected, not an error.
    """
    while True:
        try:
            return await trio.open_unix_socket(os.fspath(path))
        except PermissionError as e:
            raise PermissionDenied(f"connecting to guest socket {path}: {e}") from e
        except OSError as e:
            error = e
        now = trio.current_time()
        if now >= deadline:
            raise DeadlineExceeded(f"guest socket {path} did not accept a connection before "
                                   f"the deadline: {error}")
        await trio.sleep(min(interval, deadline - now))


class _Pending:
    __slots__ = ("abandoned", "done", "error", "on_result", "result")

    def __init__(self, on_result: Callable[[dict[str, Any]], Any] | None) -> None:
        self.done = trio.Event()
        self.result: Any = None
        self.error: KibotosError | None = None
        self.on_result = on_result
        self.abandoned = False


class GuestChannel:
    """A session with one guest agent over one stream."""

    def __init__(self, stream: trio.abc.Stream,
                 accepted: tuple[int, int] = ACCEPTED_PROTOCOL_VERSIONS) -> None:
        self._stream = stream
        self.accepted = accepted
        self._outbox, self._outbox_receive = trio.open_memory_channel[bytes](math.inf)
        self._decoder = FrameDecoder()
        self._next_id = 1
        self._next_stream = 1
        self._pending: dict[int, _Pending] = {}
        self._outputs: dict[int, GuestOutputStream] = {}
        self._inputs: dict[int, GuestInputStream] = {}
        self._processes: dict[int, GuestProcess] = {}
        self._transfers: dict[int, Download | Upload] = {}
        self._ports: dict[int, GuestPort] = {}
        self._hello: GuestInfo | None = None
        self._hello_event = trio.Event()
        self._error: KibotosError | None = None
        self._closed_event = trio.Event()
        self._frames_in = self._frames_out = self._protocol_errors = 0

    # -- public API

    @property
    def hello(self) -> GuestInfo | None:
        """The latest hello, or None before the first."""
        return self._hello

    @property
    def error(self) -> KibotosError | None:
        """Why the channel ended (guest gone, protocol violation, closed by us), or None
        while it is open.  A channel that ended stays ended: open a new one."""
        return self._error

    async def wait_closed(self) -> KibotosError:
        """Until the channel ends; returns why.  For holders of a long-lived channel
        (the data plane keeps one per guest and reopens it when it ends)."""
        await self._closed_event.wait()
        assert self._error is not None
        return self._error

    def statistics(self) -> ChannelStatistics:
        return ChannelStatistics(self._frames_in, self._frames_out, self._protocol_errors,
                                 len(self._processes))

    @property
    def files(self) -> GuestFiles:
        """The guest's file operations (`kibotos.guest.files`); each call checks that
        the agent announced the ``files`` capability."""
        return GuestFiles(self)

    @property
    def ports(self) -> GuestPorts:
        """TCP connections to ports on the guest's loopback (`kibotos.guest.ports`);
        each open checks that the agent announced the ``ports`` capability."""
        return GuestPorts(self)

    async def require(self, capability: str) -> None:
        """FailedPrecondition unless the guest's hello announces `capability`."""
        await self._hello_event.wait()
        if self._hello is None:
            assert self._error is not None
            raise self._error
        require_capability(self, capability)

    async def wait_hello(self, deadline: float) -> GuestInfo:
        """The guest's hello, by `deadline` (trio time); refuses an unsupported version."""
        with trio.move_on_at(deadline):
            await self._hello_event.wait()
        if self._hello is None:
            if self._error is not None:
                raise self._error
            raise DeadlineExceeded("the guest agent did not say hello before the deadline")
        return self._check_version(self._hello)

    async def guest_info(self) -> GuestInfo:
        """Ask again (the spec's GuestInfo); refuses an unsupported version."""
        body = await self._request("guest_info", {}, need_hello=False)
        return self._check_version(GuestInfo.from_wire(body))

    async def ping(self) -> float:
        """Round-trip time in seconds."""
        start = trio.current_time()
        await self._request("ping", {})
        return trio.current_time() - start

    async def configure(self, config: LaunchConfig) -> ConfigureResult:
        """Hand over the launch configuration; an identical second call changes nothing.
        A network needs a guest that can configure one (``configure.network``)."""
        if config.network is not None:
            await self.require(NETWORK_CAPABILITY)
        body = await self._request("configure", {"config": config.to_wire()})
        return ConfigureResult(bool(body.get("changed")), tuple(body.get("actions", ())),
                               body.get("config_digest"))

    async def exec(self, argv: Sequence[str], *, env: Mapping[str, str | None] | None = None,
                   cwd: str | None = None, uid: int | None = None, gid: int | None = None,
                   tty: bool = False, rows: int = 24, cols: int = 80, stdin: bool = True,
                   stdout: bool = True, stderr: bool = True, on_detach: str = "hangup",
                   window: int = DEFAULT_WINDOW, user: str | None = None) -> GuestProcess:
        """Start a process; its streams are on the returned handle.

        `user` (a name) runs it as that user, with its groups, HOME and, without a
        `cwd`, in its home (an agent without ``user_names`` refuses any but root).

        With ``tty=True`` output and errors share one stream (`stdout`).  Unwanted streams
        are connected to /dev/null in the guest.  ``on_detach`` says what happens if this
        connection drops first: ``hangup`` (SIGHUP to its group) or ``keep``.
        """
        if isinstance(argv, str | bytes) or not argv:
            raise InvalidArgument("exec: argv must be a non-empty sequence of strings")
        as_user = await user_fields(self, user)  # before any stream is taken
        streams: dict[str, int] = {}
        for name, wanted in (("stdin", stdin), ("stdout", stdout or tty),
                             ("stderr", stderr and not tty)):
            if wanted:
                streams[name] = self._next_stream
                self._next_stream += 1
        inp = GuestInputStream(self, streams["stdin"], tty) if "stdin" in streams else None
        outs = {n: GuestOutputStream(self, streams[n], window)
                for n in ("stdout", "stderr") if n in streams}
        if inp is not None:
            self._inputs[inp.stream_id] = inp
        for out in outs.values():
            self._outputs[out.stream_id] = out

        def started(body: dict[str, Any], pending: _Pending) -> GuestProcess:
            proc = GuestProcess(self, int(body["process"]), int(body["pid"]), tty=tty,
                                stdin=inp, stdout=outs.get("stdout"),
                                stderr=outs.get("stderr"))
            self._processes[proc.process_id] = proc
            if inp is not None:
                inp._add_credit(int(body.get("stdin_window", 0)))
            if pending.abandoned:  # the caller gave up: do not leave it running unseen
                self._send_nowait(encode_control({
                    "type": "signal", "id": self._take_id(), "process": proc.process_id,
                    "signal": "KILL", "group": True}))
            return proc

        fields: dict[str, Any] = {
            "argv": list(argv), "env": dict(env or {}), "cwd": cwd, "uid": uid, "gid": gid,
            "tty": tty, "rows": rows, "cols": cols, "window": window, "on_detach": on_detach,
            **{f"{n}_stream": sid for n, sid in streams.items()}, **as_user,
        }
        try:
            proc: GuestProcess = await self._request("exec", fields, on_result=started)
        except KibotosError:  # not started (a cancelled exec may still start: keep them)
            for sid in streams.values():
                self._inputs.pop(sid, None)
                self._outputs.pop(sid, None)
            raise
        return proc

    async def run(self, argv: Sequence[str], *, input: bytes = b"",
                  **kwargs: Any) -> tuple[ExitStatus, bytes, bytes]:
        """Run to completion: (exit status, stdout, stderr).  For small outputs."""
        proc = await self.exec(argv, **kwargs)
        out = err = b""

        async def collect(stream: GuestOutputStream | None, into: str) -> None:
            nonlocal out, err
            data = await stream.read_all() if stream is not None else b""
            out, err = (data, err) if into == "out" else (out, data)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect, proc.stdout, "out")
            nursery.start_soon(collect, proc.stderr, "err")
            if proc.stdin is not None:
                await proc.stdin.send_all(input)
                await proc.stdin.aclose()
        return await proc.wait(), out, err

    async def stop_prepare(
        self, deadline: float, *, filesystems: Sequence[str] | None = None,
        sync_timeout: float = STOP_SYNC_TIMEOUT,
    ) -> StopPrepareResult:
        """End managed processes by `deadline` (trio time), then sync and freeze.

        `filesystems` defaults to the guest's retained file systems (its Volumes and the
        ones named in the launch configuration).  Raises GuestStopFailed with one of
        STOP_REASONS; the guest answers within the deadline plus its sync and freeze time.
        """
        timeout = max(0.001, deadline - trio.current_time())
        fields: dict[str, Any] = {"timeout": timeout, "sync_timeout": sync_timeout}
        if filesystems is not None:
            fields["filesystems"] = list(filesystems)
        patience = timeout + 2 * sync_timeout + 15  # kill grace, sync, freeze, slack
        with trio.move_on_after(patience) as scope:
            try:
                body = await self._request("stop_prepare", fields)
            except KibotosError as e:
                reason = e.details.get("reason")
                if reason in STOP_REASONS:
                    raise GuestStopFailed(str(reason), e.message, e.details) from None
                raise
        if scope.cancelled_caught:
            raise GuestStopFailed("deadline_exceeded", "deadline_exceeded: the guest did not "
                                  f"answer within {patience:g}s", {})
        return StopPrepareResult(tuple(body.get("ended", ())), tuple(body.get("synced", ())),
                                 tuple(body.get("frozen", ())))

    async def sync(self, timeout: float = 10.0) -> None:
        """A short sync of everything (``stop --force``); DeadlineExceeded if it hangs."""
        with trio.move_on_after(timeout + 5) as scope:
            await self._request("sync", {"timeout": timeout})
        if scope.cancelled_caught:
            raise DeadlineExceeded(f"the guest did not finish sync within {timeout:g}s")

    async def thaw(self) -> tuple[str, ...]:
        """Undo stop_prepare's freeze; the guest accepts exec again."""
        body = await self._request("thaw", {})
        return tuple(body.get("thawed", ()))

    # -- plumbing

    def _check_version(self, info: GuestInfo) -> GuestInfo:
        low, high = self.accepted
        if not low <= info.protocol_version <= high:
            raise GuestProtocolUnsupported(info, self.accepted)
        return info

    def _new_stream_id(self) -> int:
        self._next_stream += 1
        return self._next_stream - 1

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _send_nowait(self, frame: bytes) -> None:
        if self._error is None:
            self._frames_out += 1
            self._outbox.send_nowait(frame)

    def _request_nowait(self, kind: str, fields: dict[str, Any],
                        on_answer: Callable[[], None]) -> None:
        """A request nobody waits for; `on_answer` runs when its result arrives."""
        if self._error is None:
            rid = self._take_id()
            self._pending[rid] = _Pending(lambda body: on_answer())
            self._send_nowait(encode_control({"type": kind, "id": rid, **fields}))

    async def _request(self, kind: str, fields: dict[str, Any], *, need_hello: bool = True,
                       on_result: Callable[[dict[str, Any], _Pending], Any] | None = None) -> (
        Any
    ):
        if need_hello:
            await self._hello_event.wait()
            if self._hello is None:
                assert self._error is not None
                raise self._error
            self._check_version(self._hello)
        if self._error is not None:
            raise self._error
        rid = self._take_id()
        pending = _Pending(None)
        if on_result is not None:
            pending.on_result = lambda body: on_result(body, pending)
        self._pending[rid] = pending
        try:
            self._send_nowait(encode_control({"type": kind, "id": rid, **fields}))
            await pending.done.wait()
        except BaseException:
            pending.abandoned = True
            raise
        finally:
            if not pending.abandoned:  # an abandoned one stays until its answer comes
                self._pending.pop(rid, None)
        if pending.error is not None:
            raise pending.error
        return pending.result

    def _fail(self, error: KibotosError) -> None:
        """The channel is over: everything waiting learns why."""
        if self._error is not None:
            return
        self._error = error
        self._outbox.close()
        self._fail_session(error)
        self._hello_event.set()
        self._closed_event.set()

    def _fail_session(self, error: KibotosError) -> None:
        for pending in self._pending.values():
            pending.error = error
            pending.done.set()
        self._pending.clear()
        for proc in self._processes.values():
            proc._fail(error)
        for stream in self._outputs.values():
            stream._fail(error)
        for inp in self._inputs.values():
            inp._fail(error)
        for transfer in self._transfers.values():
            transfer._fail(error)
        for port in self._ports.values():
            port._fail(error)
        self._transfers.clear()
        self._ports.clear()
        self._processes.clear()
        self._outputs.clear()
        self._inputs.clear()

    async def _writer(self) -> None:
        async with self._outbox_receive:
            async for frame in self._outbox_receive:
                frames = [frame]
                while len(frames) < 64:
                    try:
                        frames.append(self._outbox_receive.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                try:
                    await self._stream.send_all(b"".join(frames))
                except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                    self._fail(Unavailable(f"guest channel closed: {e}"))
                    return

    async def _reader(self) -> None:
        try:
            while True:
                try:
                    data = await self._stream.receive_some(RECEIVE_SIZE)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                if not data:
                    self._fail(Unavailable("guest channel closed"))
                    return
                for item in self._decoder.feed(bytes(data)):
                    if isinstance(item, FrameError):
                        self._protocol_errors += 1
                        log.warning("guest channel: %s", item.message)
                        continue
                    self._frames_in += 1
                    if item.kind == KIND_CONTROL:
                        self._on_control(item.payload)
                    else:
                        self._on_data(item.stream, item.payload, bool(item.flags & 1))
        except (GuestProtocolViolation, KibotosError, ValueError, TypeError, KeyError) as e:
            self._fail(Internal(f"guest protocol violation: {e}"))

    def _on_data(self, stream_id: int, data: bytes, eof: bool) -> None:
        stream = self._outputs.get(stream_id)
        if stream is None:  # ids are never reused, so this cannot corrupt another stream
            if self._hello is None:  # the tail of a previous host's session: expected
                log.debug("data on stream %s before hello ignored", stream_id)
                return
            self._protocol_errors += 1
            log.warning("guest sent data on unknown stream %s", stream_id)
            return
        stream._feed(data, eof)
        if eof:
            del self._outputs[stream_id]

    def _on_control(self, payload: bytes) -> None:
        msg = json.loads(payload)
        if not isinstance(msg, dict):
            raise GuestProtocolViolation("control message is not a JSON object")
        kind = msg.get("type")
        if kind == "response":
            pending = self._pending.pop(msg.get("id"), None)  # type: ignore[arg-type]
            if pending is None:
                return  # a request abandoned by its caller, or the abandoned exec's signal
            error = msg.get("error")
            if isinstance(error, dict):
                pending.error = error_of(error)
            else:
                result = msg.get("result")
                if not isinstance(result, dict):
                    raise GuestProtocolViolation(f"response without result or error: {msg!r}")
                pending.result = result if pending.on_result is None else pending.on_result(result)
            pending.done.set()
        elif kind == "hello":
            info = GuestInfo.from_wire(msg)
            if self._hello is not None and info.instance_id != self._hello.instance_id:
                self._fail_session(Unavailable("the guest agent restarted"))
            self._hello = info
            self._hello_event.set()
        elif kind == "exit":
            proc = self._processes.pop(msg.get("process"), None)  # type: ignore[arg-type]
            if proc is not None:
                proc._set_exit(ExitStatus.from_wire(msg))
        elif kind == "window":
            inp = self._inputs.get(msg.get("stream"))  # type: ignore[arg-type]
            amount = msg.get("bytes")
            if inp is not None and isinstance(amount, int) and amount > 0:
                inp._add_credit(amount)
        elif kind == "transfer_end":
            transfer = self._transfers.pop(msg.get("stream"), None)  # type: ignore[arg-type]
            if transfer is not None:  # (none: one we cancelled and forgot)
                transfer._end(msg)
            self._outputs.pop(msg.get("stream"), None)  # type: ignore[arg-type]
        elif kind == "port_end":
            port = self._ports.get(msg.get("stream"))  # type: ignore[arg-type]
            if port is not None:
                port._end(msg)
        elif kind == "stream_closed":
            inp = self._inputs.pop(msg.get("stream"), None)  # type: ignore[arg-type]
            if inp is not None:
                inp._fail(Unavailable("the guest process closed its stdin"))
        elif kind == "protocol_error":
            self._protocol_errors += 1
            error = msg.get("error")
            text = "guest reports a protocol error: " + str(
                error.get("message") if isinstance(error, dict) else error
            )
            pending = self._pending.pop(msg.get("id"), None)  # type: ignore[arg-type]
            if pending is not None:
                pending.error = InvalidArgument(text)
                pending.done.set()
            else:
                log.warning("%s", text)
        else:
            log.warning("guest sent an unknown message type %r", kind)


@asynccontextmanager
async def open_guest_channel(stream: trio.abc.Stream, *,
                             accepted: tuple[int, int] = ACCEPTED_PROTOCOL_VERSIONS,
                             resync: bool = True) -> AsyncIterator[GuestChannel]:
    """A GuestChannel over `stream`, closed (with the stream) on exit.

    `resync` sends the zero preamble first, which a virtio-serial guest needs if a
    previous host died halfway through a frame; on a fresh unix socket it is harmless.
    """
    channel = GuestChannel(stream, accepted)
    if resync:
        channel._outbox.send_nowait(bytes(RESYNC_PREAMBLE_SIZE))
    channel._send_nowait(encode_control({"type": "hello_request"}))
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(channel._reader)
            nursery.start_soon(channel._writer)
            try:
                yield channel
            finally:
                channel._fail(Unavailable("guest channel closed by the host"))
                nursery.cancel_scope.cancel()
    finally:
        await trio.aclose_forcefully(stream)
