"""One host connection over one file descriptor: frames in and out, and its streams.

A unix socket or an inherited descriptor ends at EOF.  A virtio-serial port does not:
while no host is connected, reads return EOF and poll reports POLLHUP, so the agent
stops reading, polls until the host is back, and greets it with a fresh hello.
"""

from __future__ import annotations

import json
import os
import select

from ..errors import AgentError
from ..log import log
from .framing import FLAG_EOF, KIND_CONTROL, Frame, FrameDecoder, FrameError, encode_control
from .loop import get_loop

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from ..core import Agent
    from ..services.bridge import Inbound, Outbound, Transfer
    from ..services.ports import PortStream
    from .loop import Handle
    from .streams import InputStream, OutputStream

#: A host that reads nothing while this much is queued for it is dropped.
MAX_OUTBOUND = 128 * 1024 * 1024


class Channel:
    """A session transport: decodes what the host sends, queues what goes to it."""

    def __init__(self, agent: Agent, name: str, fd: int, *, reconnectable: bool) -> None:
        self.agent = agent
        self.name = name
        self.fd = fd
        self.reconnectable = reconnectable
        self.decoder = FrameDecoder()
        self.out = bytearray()
        self.connected = False
        self.closed = False
        self.session = 0
        self.streams: dict[int, InputStream | OutputStream | Inbound | Outbound
                           | PortStream] = {}
        self.transfers: dict[int, Transfer] = {}  # file transfers by stream (`transfers`)
        self._writing = False
        self._timer: Handle | None = None
        os.set_blocking(fd, False)

    def start(self) -> None:
        if self.reconnectable:
            self._poll_connected()
        else:
            self._on_connect()

    def _poll_connected(self) -> None:
        self._timer = None
        if self.closed:
            return
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        events = poller.poll(0)
        if any(ev & (select.POLLHUP | select.POLLERR) for _, ev in events):
            self._timer = get_loop().call_later(0.1, self._poll_connected)
        else:
            self._on_connect()

    def _on_connect(self) -> None:
        self.connected = True
        self.decoder.reset()
        get_loop().add_reader(self.fd, self._on_readable)
        # The hello first, the log line after: the console is slow in a TCG guest.
        self.send_control({"type": "hello", **self.agent.hello()})
        log.info("%s: host connected", self.name)

    def _on_readable(self) -> None:
        try:
            data = os.read(self.fd, 256 * 1024)
        except BlockingIOError:
            return
        except OSError as e:
            log.info("%s: read failed: %s", self.name, e)
            data = b""
        if not data:
            self.disconnect()
            return
        for item in self.decoder.feed(data):
            if isinstance(item, FrameError):
                self.protocol_error(item.message, stream=item.stream)
            elif item.kind == KIND_CONTROL:
                self._on_control(item.payload)
            else:
                self._on_data(item)
            if not self.connected:
                break

    def _on_control(self, payload: bytes) -> None:
        try:
            msg = json.loads(payload)
        except ValueError as e:
            self.protocol_error(f"control frame is not JSON: {e}")
            return
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            self.protocol_error("control message is not an object with a string 'type'",
                                request_id=msg.get("id") if isinstance(msg, dict) else None)
            return
        self.agent.dispatch(self, msg)

    def _on_data(self, frame: Frame) -> None:
        stream = self.streams.get(frame.stream)
        if stream is None or not hasattr(stream, "on_data"):  # stdin, or an upload
            self.protocol_error(f"data for stream {frame.stream}, which is not an open input",
                                stream=frame.stream)
            return
        try:
            stream.on_data(frame.payload, bool(frame.flags & FLAG_EOF))
        except AgentError as e:
            self.protocol_error(e.message, stream=frame.stream)

    def protocol_error(self, message: str, *, stream: int | None = None,
                       request_id: Any = None) -> None:
        log.warning("%s: protocol error: %s", self.name, message)
        msg: dict[str, Any] = {"type": "protocol_error",
                               "error": {"code": "invalid_argument", "message": message}}
        if stream is not None:
            msg["stream"] = stream
        if isinstance(request_id, int) and not isinstance(request_id, bool):
            msg["id"] = request_id
        self.send_control(msg)

    def send_control(self, message: dict[str, Any]) -> None:
        self.send_frame(encode_control(message))

    def send_frame(self, frame: bytes) -> None:
        if not self.connected:
            return  # nobody is listening; the host resynchronises with hello_request
        if not self.out:
            try:
                n = os.write(self.fd, frame)
            except BlockingIOError:
                n = 0
            except OSError as e:
                log.info("%s: write failed: %s", self.name, e)
                self.disconnect()
                return
            frame = frame[n:]
            if not frame:
                return
        self.out += frame
        if len(self.out) > MAX_OUTBOUND:
            log.error("%s: host is not reading; dropping the connection", self.name)
            self.disconnect()
        elif not self._writing:
            get_loop().add_writer(self.fd, self._on_writable)
            self._writing = True

    def _on_writable(self) -> None:
        try:
            n = os.write(self.fd, self.out)
        except BlockingIOError:
            return
        except OSError as e:
            log.info("%s: write failed: %s", self.name, e)
            self.disconnect()
            return
        del self.out[:n]
        if not self.out:
            get_loop().remove_writer(self.fd)
            self._writing = False

    def new_session(self) -> None:
        """Forget everything the previous host on this channel had open."""
        self.agent.detach_session(self)
        self.session += 1

    def disconnect(self) -> None:
        if not self.connected:
            return
        loop = get_loop()
        self.connected = False
        loop.remove_reader(self.fd)
        if self._writing:
            loop.remove_writer(self.fd)
            self._writing = False
        self.out.clear()
        self.decoder.reset()
        self.new_session()
        log.info("%s: host disconnected", self.name)
        if self.closed:
            return
        if self.reconnectable:
            self._timer = loop.call_later(0.1, self._poll_connected)
        else:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.disconnect()
        if self._timer is not None:
            self._timer.cancel()
        os.close(self.fd)
        self.agent.channel_closed(self)
