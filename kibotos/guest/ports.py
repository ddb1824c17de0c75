"""The host end of the guest's ``ports`` requests: a TCP connection to a port on the
guest's loopback as a trio `HalfCloseableStream` (docs/guest-protocol.md, "Ports").

::

    port = await guest.ports.open(8080)      # FailedPrecondition if the agent lacks "ports"
    async with port:
        await port.send_all(b"GET / HTTP/1.0\\r\\n\\r\\n")
        await port.send_eof()                 # the guest's server reads EOF
        async for chunk in port: ...          # until the server shut down its side
        error = await port.wait_ended()       # None, or why the connection broke

Both directions move under the guest protocol's credit (the same classes as a process's
stdin and stdout), so a slow reader on either side stalls the writer on the other.
Nothing listening is `Unavailable` with ``details.reason == "connection_refused"``.
A stream closed before both directions ended is closed in the guest too (``port_close``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

from kibotos.core.errors import InvalidArgument, KibotosError, Unavailable, error_of
from kibotos.guest.kibotos_guest.runtime.framing import DEFAULT_WINDOW, MAX_PAYLOAD, MAX_WINDOW
from kibotos.guest.streams import GuestInputStream, GuestOutputStream

if TYPE_CHECKING:
    from kibotos.guest.client import GuestChannel

#: The guest addresses a port may be opened on (None: 127.0.0.1, then ::1).
LOOPBACK_HOSTS = ("127.0.0.1", "::1")


def _error(body: Any) -> KibotosError:
    if not isinstance(body, dict):
        return Unavailable(f"the guest ended the connection: {body!r}")
    return error_of(body, Unavailable)


class GuestPort(trio.abc.HalfCloseableStream):
    """One TCP connection in the guest; created by `GuestPorts.open`."""

    def __init__(self, channel: GuestChannel, stream_id: int, port: int,
                 window: int) -> None:
        self._channel = channel
        self.stream_id = stream_id
        self.port = port
        self.address = ""  #: the guest address it connected to, ``127.0.0.1:8080``
        self._out = GuestOutputStream(channel, stream_id, window)
        self._in = GuestInputStream(channel, stream_id, False, chunk=MAX_PAYLOAD)
        self._ended = trio.Event()
        self._error: KibotosError | None = None
        self._closed = False
        self.sent = self.received = 0  #: as the guest counted them, once ended

    # -- the guest's word

    def _end(self, message: dict[str, Any]) -> None:
        """``port_end``: the socket in the guest is closed (an error, or both ends done);
        nothing more comes on the stream."""
        if "error" in message:
            self._fail(_error(message["error"]))
            # The guest keeps a failed stream (dropping our frames still on their way)
            # until we say we are done with it.
            self._send_close(forget=False)
        for key in ("sent", "received"):
            value = message.get(key)
            if isinstance(value, int):
                setattr(self, key, value)
        self._forget()
        self._ended.set()

    def _fail(self, error: KibotosError) -> None:
        if self._error is None:
            self._error = error
        self._out._fail(error)
        self._in._fail(error)
        self._ended.set()

    def _forget(self) -> None:
        channel = self._channel
        channel._outputs.pop(self.stream_id, None)
        channel._inputs.pop(self.stream_id, None)
        channel._ports.pop(self.stream_id, None)

    def _send_close(self, *, forget: bool) -> None:
        """``port_close``; with `forget`, the stream stays registered (its output
        dropped and credited) until the guest's answer, after which nothing of it can
        arrive any more."""
        self._channel._request_nowait("port_close", {"stream": self.stream_id},
                                      self._forget if forget else lambda: None)

    def _discard_output(self) -> None:
        """Stop reading: what still arrives is dropped and credited back."""
        self._out.discard()

    # -- the stream

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        try:
            return await self._out.receive_some(max_bytes)
        except trio.BrokenResourceError:
            raise trio.BrokenResourceError(self._why()) from self._error

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            await self._in.send_all(data)
        except trio.BrokenResourceError:
            raise trio.BrokenResourceError(self._why()) from self._error

    async def wait_send_all_might_not_block(self) -> None:
        await self._in.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        """Half-close: the guest's server reads EOF; reading goes on."""
        await self._in.aclose()

    async def wait_ended(self) -> KibotosError | None:
        """Until the guest closed its socket; None when both directions ended cleanly."""
        await self._ended.wait()
        return self._error

    @property
    def error(self) -> KibotosError | None:
        return self._error

    def _why(self) -> str:
        return self._error.message if self._error is not None else \
            f"the connection to guest port {self.port} broke"

    async def aclose(self) -> None:
        """Done with it: a connection still open in the guest is closed there."""
        self._abandon()
        await trio.lowlevel.checkpoint()

    def _abandon(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._ended.is_set():
            self._forget()
            return
        self._fail(Unavailable(f"the connection to guest port {self.port} was closed by "
                               "the host"))
        self._discard_output()
        self._send_close(forget=True)


class GuestPorts:
    """The ``ports`` requests of one channel (`GuestChannel.ports`)."""

    def __init__(self, channel: GuestChannel) -> None:
        self._channel = channel

    async def open(self, port: int, *, host: str | None = None,
                   window: int = DEFAULT_WINDOW) -> GuestPort:
        """Connect to `port` on the guest's loopback (`host` one of `LOOPBACK_HOSTS`,
        None for 127.0.0.1 then ::1).  `Unavailable` (``details.reason``
        ``connection_refused``) when nothing listens there."""
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise InvalidArgument(f"port must be an integer from 1 to 65535, not {port!r}")
        if host is not None and host not in LOOPBACK_HOSTS:
            raise InvalidArgument(f"host must be one of {list(LOOPBACK_HOSTS)}, not {host!r}")
        if not 1 <= window <= MAX_WINDOW:
            raise InvalidArgument(f"window must be from 1 to {MAX_WINDOW} bytes")
        channel = self._channel
        await channel.require("ports")
        sid = channel._new_stream_id()
        stream = GuestPort(channel, sid, port, window)
        channel._outputs[sid] = stream._out
        channel._inputs[sid] = stream._in
        channel._ports[sid] = stream
        fields: dict[str, Any] = {"port": port, "stream": sid, "window": window}
        if host is not None:
            fields["host"] = host
        try:
            body = await channel._request("port_open", fields, on_result=_opened(stream))
        except BaseException:
            # Refused, or abandoned (cancelled): an abandoned open that succeeds later
            # is closed again by `_opened`.
            stream._forget()
            raise
        assert isinstance(body, GuestPort)
        return body


def _opened(stream: GuestPort) -> Any:
    def on_result(body: dict[str, Any], pending: Any) -> GuestPort:
        stream.address = str(body.get("address", ""))
        stream._in._add_credit(int(body.get("stream_window", 0)))
        if pending.abandoned:  # the caller gave up: do not leave it open unseen
            channel = stream._channel
            channel._outputs[stream.stream_id] = stream._out
            channel._ports[stream.stream_id] = stream
            stream._abandon()
        return stream

    return on_result
