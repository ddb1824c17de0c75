#!/usr/bin/env python3
"""kibotos-guest: the agent inside every Workspace VM.

This one file is copied into Template images that carry only Debian's ``python3``, so it
uses the standard library alone and runs on Python 3.11.  It serves the guest protocol
(docs/guest-protocol.md) over a virtio-serial port found by name, over an inherited file
descriptor, over any character device, or (for tests on the host) over a unix socket:

    python3 agent.py [--port-name org.kibotos.agent.0] [--device PATH] [--socket PATH]
                     [--fd N] [--root DIR]

The host side imports the framing from here (`kibotos.guest.client`), so the two ends
cannot drift apart.  Everything the agent does is driven by one asyncio loop: channel
I/O, process pipes and SIGCHLD.  Blocking kernel calls (mount, syncfs, FIFREEZE) run in
worker threads with deadlines, because a stuck disk must not stop the agent answering.
"""

from __future__ import annotations

import argparse
import asyncio
import binascii
import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import pwd
import re
import secrets
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import termios
import time
import tty
from collections.abc import Callable, Coroutine
from typing import Any

PROTOCOL_VERSION = 1
AGENT_VERSION = "0.1.0"
DEFAULT_PORT_NAME = "org.kibotos.agent.0"
CAPABILITIES = (
    "configure.dns", "configure.env", "configure.hostname", "configure.volumes", "exec",
    "exec.tty", "exec.user", "flow_control", "freeze", "ping", "resize", "signal",
    "stop_prepare", "sync", "thaw",
)

# Framing: a 24-byte header, then the payload.  See docs/guest-protocol.md.
MAGIC = b"\x8bKGP"
KIND_CONTROL = 1
KIND_DATA = 2
FLAG_EOF = 0x01
_HEAD = struct.Struct("!4sBBHIII")  # magic kind flags reserved stream length payload-crc
_CRC = struct.Struct("!I")
HEADER_SIZE = _HEAD.size + _CRC.size
MAX_PAYLOAD = 256 * 1024
DATA_CHUNK = 64 * 1024
DEFAULT_WINDOW = 256 * 1024
MAX_WINDOW = 16 * 1024 * 1024
#: Zero bytes a host sends first on every connect: enough to complete any frame a dead
#: predecessor left half-written, after which zeros are padding the decoder skips.
RESYNC_PREAMBLE_SIZE = HEADER_SIZE + MAX_PAYLOAD
_MAX_OUTBOUND = 128 * 1024 * 1024

FIFREEZE = 0xC0045877
FITHAW = 0xC0045878
_PR_SET_CHILD_SUBREAPER = 36
_KILL_GRACE = 5.0
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
FS_TYPES = ("ext4",)

log = logging.getLogger("kibotos-guest")


# ---------------------------------------------------------------------------- framing


@dataclasses.dataclass(frozen=True)
class Frame:
    kind: int
    flags: int
    stream: int
    payload: bytes


@dataclasses.dataclass(frozen=True)
class FrameError:
    """Bytes that are not a valid frame; the decoder has already resynchronised."""

    message: str
    stream: int | None = None


def encode_frame(kind: int, stream: int, payload: bytes, flags: int = 0) -> bytes:
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"frame payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    head = _HEAD.pack(MAGIC, kind, flags, 0, stream, len(payload), binascii.crc32(payload))
    return head + _CRC.pack(binascii.crc32(head)) + payload


def encode_control(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode()
    return encode_frame(KIND_CONTROL, 0, body)


def encode_data(stream: int, data: bytes, *, eof: bool = False) -> bytes:
    return encode_frame(KIND_DATA, stream, data, FLAG_EOF if eof else 0)


class FrameDecoder:
    """Turns a byte stream into frames; skips zero padding; resynchronises on garbage.

    Garbage is reported once per run (not once per byte), then the decoder scans for the
    next magic whose header checksum holds.  Both ends use this class.
    """

    def __init__(self, max_payload: int = MAX_PAYLOAD) -> None:
        self._buf = bytearray()
        self._max = max_payload
        self._in_garbage = False

    def reset(self) -> None:
        self._buf.clear()
        self._in_garbage = False

    def buffered(self) -> int:
        return len(self._buf)

    def _garbage(self, out: list[Frame | FrameError], message: str, drop: int) -> None:
        del self._buf[:drop]
        if not self._in_garbage:
            out.append(FrameError(message))
            self._in_garbage = True

    def feed(self, data: bytes) -> list[Frame | FrameError]:
        buf = self._buf
        buf += data
        out: list[Frame | FrameError] = []
        while buf:
            if buf[0] == 0:  # padding between frames
                stripped = len(buf) - len(buf.lstrip(b"\0"))
                del buf[:stripped]
                continue
            if not buf.startswith(MAGIC):
                found = buf.find(MAGIC)
                if found < 0:  # keep a tail that may be the start of the next magic
                    keep = next((k for k in (3, 2, 1) if k <= len(buf)
                                 and MAGIC.startswith(bytes(buf[-k:]))), 0)
                    if keep == len(buf):
                        break
                    found = len(buf) - keep
                self._garbage(out, "bytes that are not a frame", found)
                continue
            if len(buf) < HEADER_SIZE:
                break
            _, kind, flags, _, stream, length, pcrc = _HEAD.unpack_from(buf)
            (hcrc,) = _CRC.unpack_from(buf, _HEAD.size)
            if binascii.crc32(buf[: _HEAD.size]) != hcrc:
                self._garbage(out, "frame header checksum mismatch", 1)
                continue
            if kind not in (KIND_CONTROL, KIND_DATA) or length > self._max:
                self._garbage(out, f"invalid frame header (kind {kind}, length {length})", 1)
                continue
            if len(buf) < HEADER_SIZE + length:
                break
            payload = bytes(buf[HEADER_SIZE : HEADER_SIZE + length])
            del buf[: HEADER_SIZE + length]
            self._in_garbage = False
            if binascii.crc32(payload) != pcrc:
                out.append(FrameError("frame payload checksum mismatch; frame dropped", stream))
                continue
            out.append(Frame(kind, flags, stream, payload))
        return out


# ---------------------------------------------------------------------------- errors


class AgentError(Exception):
    """An error answered to the host as ``{code, message, details?}``."""

    def __init__(self, code: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details or {}

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            body["details"] = self.details
        return body


def _invalid(message: str) -> AgentError:
    return AgentError("invalid_argument", message)


def _field(msg: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    """Read one field of a request, naming the request and field when it is wrong."""
    if key not in msg or msg[key] is None:
        if default is ...:
            raise _invalid(f"{msg.get('type')}: field {key!r} is required")
        return default
    value = msg[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise _invalid(f"{msg.get('type')}: field {key!r} has the wrong type")
    return value


def _int_field(msg: dict[str, Any], key: str, lo: int, hi: int, default: Any = ...) -> Any:
    value = _field(msg, key, int, default)
    if value is not None and value is not default and not lo <= value <= hi:
        raise _invalid(f"{msg.get('type')}: field {key!r} must be in {lo}..{hi}")
    return value


def _seconds_field(msg: dict[str, Any], key: str, default: Any = ...) -> float:
    value = float(_field(msg, key, (int, float), default))
    if not 0 < value <= 86400:
        raise _invalid(f"{msg.get('type')}: field {key!r} must be in (0, 86400] seconds")
    return value


def _guest_path(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        raise _invalid(f"{what} must be an absolute path, got {value!r}")
    if ".." in value.split("/"):
        raise _invalid(f"{what} must not contain '..', got {value!r}")
    return os.path.normpath(value)


# ---------------------------------------------------------------------------- host facts


def read_boot_id(path: str = "/proc/sys/kernel/random/boot_id") -> str:
    with open(path) as f:
        return f.read().strip()


def atomic_write(path: str, data: bytes, mode: int = 0o644) -> None:
    """Temporary file, fsync, rename, fsync of the directory: never a torn file."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}-{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


@dataclasses.dataclass(frozen=True)
class MountEntry:
    mount_point: str
    dev: tuple[int, int]
    fs_type: str
    source: str


def read_mounts(path: str = "/proc/self/mountinfo") -> list[MountEntry]:
    def unescape(s: str) -> str:
        return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)

    entries = []
    with open(path) as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            major, minor = fields[2].split(":")
            entries.append(
                MountEntry(unescape(fields[4]), (int(major), int(minor)), fields[sep + 1],
                           unescape(fields[sep + 2]))
            )
    return entries


def mount_at(path: str) -> MountEntry | None:
    """The mount on top of `path`, if `path` is a mount point."""
    found = None
    for entry in read_mounts():
        if entry.mount_point == path:
            found = entry
    return found


_LIBC: Any = None


def _libc_call(name: str, *args: Any) -> None:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    if getattr(_LIBC, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def sys_mount(source: str, target: str, fs_type: str, flags: int, data: str) -> None:
    _libc_call("mount", source.encode(), target.encode(), fs_type.encode(),
               ctypes.c_ulong(flags), data.encode() if data else None)


def find_port_device(name: str, sysfs: str = "/sys/class/virtio-ports", dev: str = "/dev") -> (
    str | None
):
    """The /dev node of the virtio-serial port called `name`, if it has appeared."""
    try:
        entries = sorted(os.listdir(sysfs))
    except FileNotFoundError:
        return None
    for entry in entries:
        if (_read_text(os.path.join(sysfs, entry, "name")) or "").strip() == name:
            return os.path.join(dev, entry)
    return None


def _signal_number(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        if not 1 <= value < signal.NSIG:
            raise _invalid(f"signal: no signal number {value}")
        return value
    if isinstance(value, str):
        name = value.upper() if value.upper().startswith("SIG") else "SIG" + value.upper()
        try:
            return int(signal.Signals[name])
        except KeyError:
            pass
    raise _invalid(f"signal: unknown signal {value!r}")


def _exit_fields(status: int) -> dict[str, Any]:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"SIG{sig}"
        return {"exit_code": None, "signal": sig, "signal_name": name}
    return {"exit_code": os.WEXITSTATUS(status), "signal": None, "signal_name": None}


# ---------------------------------------------------------------------------- streams


class OutputStream:
    """Process output (a pipe or a pty master) sent to the host within its credit window.

    The pipe is read only while the host has granted credit, so a fast producer blocks
    on its own full pipe instead of filling the agent's memory.
    """

    def __init__(self, channel: Channel, stream_id: int, fd: int, window: int,
                 proc: ManagedProcess) -> None:
        self.channel: Channel | None = channel
        self.stream_id = stream_id
        self.fd = fd
        self.window = window
        self.proc = proc
        self.reading = False
        self.closed = False
        os.set_blocking(fd, False)

    def start(self) -> None:
        if not self.closed and not self.reading and (self.window > 0 or self.channel is None):
            asyncio.get_running_loop().add_reader(self.fd, self._on_readable)
            self.reading = True

    def _pause(self) -> None:
        if self.reading:
            asyncio.get_running_loop().remove_reader(self.fd)
            self.reading = False

    def _on_readable(self) -> None:
        size = DATA_CHUNK if self.channel is None else min(self.window, DATA_CHUNK)
        try:
            data = os.read(self.fd, size)
        except BlockingIOError:
            return
        except OSError as e:  # EIO: every slave side of a pty has closed
            if e.errno != errno.EIO:
                log.warning("reading output of process %s: %s", self.proc.process_id, e)
            data = b""
        if not data:
            self.close(send_eof=True)
            return
        if self.channel is None:  # detached with on_detach=keep: drain and drop
            return
        self.window -= len(data)
        self.channel.send_frame(encode_data(self.stream_id, data))
        if self.window <= 0:
            self._pause()

    def credit(self, amount: int) -> None:
        if self.window + amount > MAX_WINDOW:
            raise _invalid(f"window: credit for stream {self.stream_id} exceeds {MAX_WINDOW}")
        self.window += amount
        self.start()

    def detach(self) -> None:
        if self.proc.on_detach == "keep" and not self.closed:
            self.channel = None
            self.start()
        else:
            self.close(send_eof=False)

    def close(self, *, send_eof: bool) -> None:
        if self.closed:
            return
        self._pause()
        self.closed = True
        os.close(self.fd)
        if self.channel is not None:
            if send_eof:
                self.channel.send_frame(encode_data(self.stream_id, b"", eof=True))
            self.channel.streams.pop(self.stream_id, None)


class InputStream:
    """Host bytes for a process's stdin (a pipe or a pty master), buffered within credit.

    The host may have at most `window` bytes unwritten here; credit goes back to the host
    as bytes reach the pipe, so the agent never holds more than one window per stream.
    """

    def __init__(self, channel: Channel, stream_id: int, fd: int, window: int,
                 is_tty: bool) -> None:
        self.channel = channel
        self.stream_id = stream_id
        self.fd = fd
        self.window = window
        self.is_tty = is_tty
        self.buf = bytearray()
        self.eof = False
        self.broken = False
        self.writing = False
        os.set_blocking(fd, False)

    def on_data(self, data: bytes, eof: bool) -> None:
        if len(data) > self.window:
            raise _invalid(f"data: {len(data)} bytes for stream {self.stream_id} exceed its "
                           f"credit of {self.window}")
        if self.broken:  # the process closed its stdin: discard, but give the credit back
            self._return_credit(len(data))
            return
        self.window -= len(data)
        self.buf += data
        self.eof = self.eof or eof
        self.flush()

    def flush(self) -> None:
        written = 0
        while self.buf:
            try:
                n = os.write(self.fd, self.buf[:DATA_CHUNK])
            except BlockingIOError:
                break
            except OSError:  # EPIPE: the reader has gone
                self._broken()
                return
            del self.buf[:n]
            written += n
        if written:
            self.window += written
            self._return_credit(written)
        loop = asyncio.get_running_loop()
        if self.buf and not self.writing:
            loop.add_writer(self.fd, self.flush)
            self.writing = True
        elif not self.buf:
            if self.writing:
                loop.remove_writer(self.fd)
                self.writing = False
            if self.eof:
                self._finish_eof()

    def _return_credit(self, amount: int) -> None:
        self.channel.send_control({"type": "window", "stream": self.stream_id, "bytes": amount})

    def _finish_eof(self) -> None:
        if self.is_tty:  # a pty cannot be half-closed: send the EOF character instead
            with contextlib.suppress(OSError):
                os.write(self.fd, termios.tcgetattr(self.fd)[6][termios.VEOF])
        self.close()

    def _broken(self) -> None:
        self.broken = True
        if self.buf:
            self._return_credit(len(self.buf))
            self.window += len(self.buf)
            self.buf.clear()
        if self.writing:
            asyncio.get_running_loop().remove_writer(self.fd)
            self.writing = False
        self.channel.send_control({"type": "stream_closed", "stream": self.stream_id})

    def detach(self) -> None:
        self.close()

    def close(self) -> None:
        if self.fd < 0:
            return
        if self.writing:
            asyncio.get_running_loop().remove_writer(self.fd)
            self.writing = False
        os.close(self.fd)
        self.fd = -1
        self.channel.streams.pop(self.stream_id, None)


@dataclasses.dataclass(eq=False)
class ManagedProcess:
    """A process the agent started: its session is ended by stop_prepare."""

    process_id: int
    pid: int
    argv: list[str]
    popen: subprocess.Popen[bytes]
    channel: Channel | None
    session: int
    on_detach: str
    master_fd: int = -1
    exited: bool = False


# ---------------------------------------------------------------------------- channel


class Channel:
    """One host connection over one file descriptor: frames in and out, its streams.

    A unix socket or an inherited descriptor ends at EOF.  A virtio-serial port does not:
    while no host is connected, reads return EOF and poll reports POLLHUP, so the agent
    stops reading, polls until the host is back, and greets it with a fresh hello.
    """

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
        self.streams: dict[int, InputStream | OutputStream] = {}
        self._writing = False
        self._timer: asyncio.TimerHandle | None = None
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
            self._timer = asyncio.get_running_loop().call_later(0.1, self._poll_connected)
        else:
            self._on_connect()

    def _on_connect(self) -> None:
        self.connected = True
        self.decoder.reset()
        asyncio.get_running_loop().add_reader(self.fd, self._on_readable)
        log.info("%s: host connected", self.name)
        self.send_control({"type": "hello", **self.agent.hello()})

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
        if not isinstance(stream, InputStream):
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
        if len(self.out) > _MAX_OUTBOUND:
            log.error("%s: host is not reading; dropping the connection", self.name)
            self.disconnect()
        elif not self._writing:
            asyncio.get_running_loop().add_writer(self.fd, self._on_writable)
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
            asyncio.get_running_loop().remove_writer(self.fd)
            self._writing = False

    def new_session(self) -> None:
        """Forget everything the previous host on this channel had open."""
        self.agent.detach_session(self)
        self.session += 1

    def disconnect(self) -> None:
        if not self.connected:
            return
        loop = asyncio.get_running_loop()
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


# ---------------------------------------------------------------------------- the agent

_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HOSTNAME = re.compile(r"(?=.{1,64}$)[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*")
_DNS_WORD = re.compile(r"[A-Za-z0-9_.:-]{1,253}")
_MOUNT_OPTIONS = re.compile(r"[A-Za-z0-9_=,.:/-]*")
_HOSTS_MARK = "# kibotos-guest"
_Result = dict[str, Any]
Handler = Callable[["Channel", _Result], "_Result | Coroutine[Any, Any, _Result]"]


def _consume(work: asyncio.Future[Any]) -> None:
    """Retrieve the outcome of work we stopped waiting for, so asyncio does not warn."""
    if not work.cancelled():
        work.exception()


def _acquire_ctty() -> None:  # runs in the child, after setsid, before exec
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _syncfs_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _libc_call("syncfs", fd)
    finally:
        os.close(fd)


def _freeze_path(path: str) -> int:
    """FIFREEZE the file system mounted at `path`; the returned descriptor thaws it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, FIFREEZE, 0)
    except OSError as e:
        if e.errno != errno.EBUSY:  # EBUSY: already frozen, which is what we want
            os.close(fd)
            raise
    return fd


class Agent:
    """The state shared by every channel: processes, configuration, frozen file systems."""

    def __init__(self, *, root: str = "/", protocol_version: int = PROTOCOL_VERSION) -> None:
        self.root = os.path.realpath(root)
        self.protocol_version = protocol_version
        self.boot_id = read_boot_id()
        self.instance_id = secrets.token_hex(8)
        self.processes: dict[int, ManagedProcess] = {}
        self.by_pid: dict[int, ManagedProcess] = {}
        self.sessions: set[int] = set()
        self.channels: set[Channel] = set()
        self.config: dict[str, Any] = {}
        self.config_digest: str | None = None
        self.env_defaults: dict[str, str] = {}
        self.frozen: dict[str, int] = {}
        self.stopping = False
        self.stop_when_idle: asyncio.Event | None = None
        self._next_process = 0
        self._config_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._prune: asyncio.TimerHandle | None = None
        self._handlers: dict[str, Handler] = {
            "guest_info": lambda ch, msg: self.hello(), "ping": self._ping,
            "exec": self._exec, "signal": self._signal, "resize": self._resize,
            "configure": self._configure, "stop_prepare": self._stop_prepare,
            "sync": self._sync, "thaw": self._thaw,
        }

    def hello(self) -> dict[str, Any]:
        return {"protocol_version": self.protocol_version, "agent_version": AGENT_VERSION,
                "boot_id": self.boot_id, "capabilities": list(CAPABILITIES),
                "instance_id": self.instance_id, "pid": os.getpid(),
                "config_digest": self.config_digest, "stopping": self.stopping,
                "frozen_filesystems": sorted(self.frozen)}

    def path(self, guest_path: str) -> str:
        """Where a guest path lives: under --root in tests, itself in a guest."""
        return guest_path if self.root == "/" else os.path.join(self.root, guest_path.lstrip("/"))

    # -- channels and dispatch

    def add_channel(self, ch: Channel) -> None:
        self.channels.add(ch)
        ch.start()

    def channel_closed(self, ch: Channel) -> None:
        self.channels.discard(ch)
        if not self.channels and self.stop_when_idle is not None:
            self.stop_when_idle.set()

    def dispatch(self, ch: Channel, msg: dict[str, Any]) -> None:
        mtype = msg["type"]
        if mtype == "window":
            stream = ch.streams.get(msg.get("stream"))  # type: ignore[arg-type]
            amount = msg.get("bytes")
            if not isinstance(amount, int) or isinstance(amount, bool) or amount <= 0:
                ch.protocol_error("window: 'bytes' must be a positive integer")
            elif isinstance(stream, OutputStream):
                try:
                    stream.credit(amount)
                except AgentError as e:
                    ch.protocol_error(e.message, stream=stream.stream_id)
            return  # credit for a stream that just ended is not an error
        if mtype == "hello_request":
            ch.new_session()
            ch.send_control({"type": "hello", **self.hello()})
            return
        rid = msg.get("id")
        if not isinstance(rid, int) or isinstance(rid, bool) or rid < 0:
            ch.protocol_error(f"request {mtype!r} has no non-negative integer 'id'")
            return
        session = ch.session
        handler = self._handlers.get(mtype)
        try:
            if handler is None:
                raise _invalid(f"unknown request type {mtype!r}")
            outcome = handler(ch, msg)
        except Exception as e:
            self._respond(ch, session, rid, e)
            return
        if isinstance(outcome, dict):
            self._respond(ch, session, rid, outcome)
            return
        task = asyncio.get_running_loop().create_task(self._finish(ch, session, rid, outcome))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _finish(self, ch: Channel, session: int, rid: int,
                      work: Coroutine[Any, Any, dict[str, Any]]) -> None:
        try:
            result: dict[str, Any] | Exception = await work
        except Exception as e:
            result = e
        self._respond(ch, session, rid, result)

    def _respond(self, ch: Channel, session: int, rid: int,
                 outcome: dict[str, Any] | Exception) -> None:
        if ch.session != session:
            return  # the host that asked has gone; its successor did not ask
        if isinstance(outcome, dict):
            ch.send_control({"type": "response", "id": rid, "result": outcome})
            return
        if not isinstance(outcome, AgentError):
            log.error("request %s failed", rid, exc_info=outcome)
            outcome = AgentError("internal", f"{type(outcome).__name__}: {outcome}")
        ch.send_control({"type": "response", "id": rid, "error": outcome.to_wire()})

    def detach_session(self, ch: Channel) -> None:
        """The host of `ch` has gone: close its streams, hang up its processes."""
        for stream in list(ch.streams.values()):
            stream.detach()
        ch.streams.clear()
        for proc in list(self.processes.values()):
            if proc.channel is ch:
                proc.channel = None
                if proc.on_detach == "hangup":
                    for sig in (signal.SIGHUP, signal.SIGCONT):
                        with contextlib.suppress(OSError):
                            os.killpg(proc.pid, sig)

    def shutdown(self) -> None:
        for ch in list(self.channels):
            ch.close()

    # -- processes

    def reap(self) -> None:
        """SIGCHLD: collect every exited child, ours or orphans handed to us."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            proc = self.by_pid.pop(pid, None)
            if proc is not None:
                self._on_exit(proc, status)

    def _on_exit(self, proc: ManagedProcess, status: int) -> None:
        proc.exited = True
        fields = _exit_fields(status)
        sig = fields["signal"]
        proc.popen.returncode = fields["exit_code"] if sig is None else -sig
        self.processes.pop(proc.process_id, None)
        if proc.master_fd >= 0:
            os.close(proc.master_fd)
            proc.master_fd = -1
        ch = proc.channel
        if ch is not None and ch.session == proc.session:
            ch.send_control({"type": "exit", "process": proc.process_id, "pid": proc.pid, **fields})
        if self._prune is None:  # forget sessions that have no members left, soon
            self._prune = asyncio.get_running_loop().call_later(1.0, self._prune_sessions)

    def _prune_sessions(self) -> None:
        self._prune = None
        self.members()

    def members(self) -> dict[int, str]:
        """Live processes of managed sessions and orphans handed to the agent: pid → name."""
        me = os.getpid()
        found: dict[int, str] = {}
        live: set[int] = set()
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == me:
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    head, _, rest = f.read().rpartition(b")")
            except OSError:
                continue
            fields = rest.split()
            if fields[0] in (b"Z", b"X"):
                continue
            session = int(fields[3])
            if session in self.sessions or int(fields[1]) == me:
                found[int(name)] = head.partition(b"(")[2].decode(errors="replace")
                live.add(session)
        self.sessions = {s for s in self.sessions if s in live or s in self.by_pid}
        return found

    def _lookup(self, msg: dict[str, Any]) -> ManagedProcess:
        process_id = _int_field(msg, "process", 1, 2**63)
        proc = self.processes.get(process_id)
        if proc is None:
            raise AgentError("not_found", f"{msg['type']}: no running process {process_id}")
        return proc

    def _identity(self, uid: int | None, gid: int | None) -> (
        tuple[int | None, int | None, list[int] | None, pwd.struct_passwd | None]
    ):
        try:
            pw: pwd.struct_passwd | None = pwd.getpwuid(os.geteuid() if uid is None else uid)
        except KeyError:
            pw = None
        if uid is None:
            return None, gid, None, pw
        if gid is None:
            gid = pw.pw_gid if pw is not None else uid
        groups = None
        if os.geteuid() == 0:  # never hand root's supplementary groups to another user
            groups = os.getgrouplist(pw.pw_name, gid) if pw is not None else [gid]
        return uid, gid, groups, pw

    def _process_env(self, overrides: dict[str, Any], pw: pwd.struct_passwd | None,
                     use_tty: bool) -> dict[str, str]:
        env = {"PATH": DEFAULT_PATH, "HOME": pw.pw_dir if pw is not None else "/"}
        if pw is not None:
            env.update(USER=pw.pw_name, LOGNAME=pw.pw_name, SHELL=pw.pw_shell or "/bin/sh")
        if use_tty:
            env["TERM"] = "xterm-256color"
        env.update(self.env_defaults)
        for key, value in overrides.items():
            if not _ENV_KEY.fullmatch(key) or not (value is None or isinstance(value, str)):
                raise _invalid(f"exec: bad environment entry {key!r}")
            if value is None:
                env.pop(key, None)
            elif "\0" in value:
                raise _invalid(f"exec: environment value of {key!r} contains NUL")
            else:
                env[key] = value
        return env

    def _ping(self, ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
        return {"monotonic": time.monotonic()}

    def _exec(self, ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
        if self.stopping:
            raise AgentError("failed_precondition", "exec: the guest is prepared for stop "
                             "and its file systems are frozen; send thaw first")
        argv = _field(msg, "argv", list)
        if not argv or not all(isinstance(a, str) and "\0" not in a for a in argv):
            raise _invalid("exec: 'argv' must be a non-empty list of strings")
        use_tty = _field(msg, "tty", bool, False)
        rows, cols = _int_field(msg, "rows", 1, 65535, 24), _int_field(msg, "cols", 1, 65535, 80)
        window = _int_field(msg, "window", 1, MAX_WINDOW, DEFAULT_WINDOW)
        on_detach = _field(msg, "on_detach", str, "hangup")
        if on_detach not in ("hangup", "keep"):
            raise _invalid("exec: 'on_detach' must be 'hangup' or 'keep'")
        ids = {n: _int_field(msg, f"{n}_stream", 1, 2**32 - 1, None)
               for n in ("stdin", "stdout", "stderr")}
        used = [i for i in ids.values() if i is not None]
        if len(set(used)) != len(used) or any(i in ch.streams for i in used):
            raise _invalid("exec: stream ids must be distinct and not already open")
        if use_tty and (ids["stderr"] is not None or ids["stdout"] is None):
            raise _invalid("exec: a tty process has one output stream: give 'stdout_stream' only")
        uid, gid, groups, pw = self._identity(_int_field(msg, "uid", 0, 2**32 - 2, None),
                                              _int_field(msg, "gid", 0, 2**32 - 2, None))
        env = self._process_env(_field(msg, "env", dict, {}), pw, use_tty)
        cwd = _field(msg, "cwd", str, None)
        if cwd is None:
            cwd = env["HOME"] if os.path.isdir(env["HOME"]) else "/"

        child_fds: list[int] = []
        parent: dict[str, int] = {}
        master = -1
        std: dict[str, int] = dict.fromkeys(ids, subprocess.DEVNULL)
        try:
            if use_tty:
                master, slave = os.openpty()
                child_fds.append(slave)
                fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
                std = dict.fromkeys(ids, slave)
            else:
                for n, sid in ids.items():
                    if sid is not None:
                        r, w = os.pipe2(os.O_CLOEXEC)
                        child, mine = (r, w) if n == "stdin" else (w, r)
                        child_fds.append(child)
                        parent[n] = mine
                        std[n] = child
            popen = subprocess.Popen(
                argv, stdin=std["stdin"], stdout=std["stdout"], stderr=std["stderr"], cwd=cwd,
                env=env, start_new_session=True, user=uid, group=gid, extra_groups=groups,
                preexec_fn=_acquire_ctty if use_tty else None,
            )
        except Exception as e:
            for fd in [*parent.values(), *([master] if master >= 0 else [])]:
                os.close(fd)
            if isinstance(e, FileNotFoundError):
                raise AgentError("not_found", f"exec: {e.filename or argv[0]}: "
                                 "no such file or directory") from None
            if isinstance(e, PermissionError):
                raise AgentError("permission_denied", f"exec: {argv[0]}: {e.strerror}") from None
            if isinstance(e, OSError):
                raise AgentError("failed_precondition", f"exec: {argv[0]}: {e}") from None
            raise
        finally:
            for fd in child_fds:
                os.close(fd)

        self._next_process += 1
        proc = ManagedProcess(self._next_process, popen.pid, list(argv), popen, ch, ch.session,
                              on_detach, master)
        self.processes[proc.process_id] = proc
        self.by_pid[proc.pid] = proc
        self.sessions.add(proc.pid)
        if use_tty:
            parent = {"stdout": os.dup(master)}
            if ids["stdin"] is not None:
                parent["stdin"] = os.dup(master)
        for n, fd in parent.items():
            sid = ids[n]
            assert sid is not None
            stream: InputStream | OutputStream
            if n == "stdin":
                stream = InputStream(ch, sid, fd, DEFAULT_WINDOW, use_tty)
            else:
                stream = OutputStream(ch, sid, fd, window, proc)
                stream.start()  # its first frame can only follow this response
            ch.streams[sid] = stream
        return {"process": proc.process_id, "pid": proc.pid, "stdin_window": DEFAULT_WINDOW}

    def _signal(self, ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
        proc = self._lookup(msg)
        sig = _signal_number(msg.get("signal"))
        try:
            if _field(msg, "group", bool, False):
                os.killpg(proc.pid, sig)
            else:
                os.kill(proc.pid, sig)
        except ProcessLookupError:
            raise AgentError("not_found", f"signal: process {proc.process_id} is gone") from None
        return {}

    def _resize(self, ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
        proc = self._lookup(msg)
        rows, cols = _int_field(msg, "rows", 1, 65535), _int_field(msg, "cols", 1, 65535)
        if proc.master_fd < 0:
            raise AgentError("failed_precondition", f"resize: process {proc.process_id} has no tty")
        fcntl.ioctl(proc.master_fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        return {}

    # -- launch configuration

    def _parse_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """Validate everything before anything is written."""
        unknown = sorted(set(cfg) - {"hostname", "env", "dns", "volumes", "retained_filesystems"})
        if unknown:
            raise _invalid(f"configure: unknown field(s) {', '.join(unknown)}")
        out: dict[str, Any] = {}
        if cfg.get("hostname") is not None:
            if not isinstance(cfg["hostname"], str) or not _HOSTNAME.fullmatch(cfg["hostname"]):
                raise _invalid(f"configure: invalid hostname {cfg['hostname']!r}")
            out["hostname"] = cfg["hostname"]
        if cfg.get("env") is not None:
            env = cfg["env"]
            if not isinstance(env, dict) or not all(
                isinstance(k, str) and _ENV_KEY.fullmatch(k) and isinstance(v, str)
                and "\0" not in v for k, v in env.items()
            ):
                raise _invalid("configure: 'env' must map variable names to strings")
            out["env"] = dict(sorted(env.items()))
        if cfg.get("dns") is not None:
            out["dns"] = self._parse_dns(cfg["dns"])
        if cfg.get("volumes") is not None:
            out["volumes"] = self._parse_volumes(cfg["volumes"])
        if cfg.get("retained_filesystems") is not None:
            if not isinstance(cfg["retained_filesystems"], list):
                raise _invalid("configure: 'retained_filesystems' must be a list of paths")
            out["retained_filesystems"] = [_guest_path(p, "configure: retained filesystem")
                                           for p in cfg["retained_filesystems"]]
        return out

    def _parse_dns(self, dns: Any) -> dict[str, list[str]]:
        import ipaddress

        if not isinstance(dns, dict) or set(dns) - {"nameservers", "search", "options"}:
            raise _invalid("configure: 'dns' takes nameservers, search and options")
        out: dict[str, list[str]] = {}
        for key, limit in (("nameservers", 3), ("search", 6), ("options", 16)):
            values = dns.get(key) or []
            if not isinstance(values, list) or len(values) > limit or not all(
                isinstance(v, str) and _DNS_WORD.fullmatch(v) for v in values
            ):
                raise _invalid(f"configure: dns {key} must be a list of at most {limit} words")
            out[key] = list(values)
        for ns in out["nameservers"]:
            try:
                ipaddress.ip_address(ns)
            except ValueError:
                raise _invalid(f"configure: dns nameserver {ns!r} is not an IP address") from None
        return out

    def _parse_volumes(self, volumes: Any) -> list[dict[str, Any]]:
        if not isinstance(volumes, list):
            raise _invalid("configure: 'volumes' must be a list")
        out: list[dict[str, Any]] = []
        for vol in volumes:
            if not isinstance(vol, dict):
                raise _invalid("configure: each volume must be an object")
            vol = {"type": "configure volume", **vol}
            device = _guest_path(_field(vol, "device", str), "configure: volume device")
            mount_point = _guest_path(_field(vol, "mount_point", str), "configure: mount point")
            fs_type = _field(vol, "fs_type", str, "ext4")
            options = _field(vol, "options", str, "")
            if mount_point == "/" or fs_type not in FS_TYPES:
                raise _invalid(f"configure: volume {mount_point} needs a mount point other than"
                               f" / and a file system type among {', '.join(FS_TYPES)}")
            if not _MOUNT_OPTIONS.fullmatch(options):
                raise _invalid(f"configure: invalid mount options {options!r}")
            try:
                is_block = stat.S_ISBLK(os.stat(device).st_mode)
            except OSError:
                is_block = False
            if not is_block:
                raise _invalid(f"configure: volume device {device} is not a block device here")
            out.append({"device": device, "mount_point": mount_point, "fs_type": fs_type,
                        "options": options, "read_only": _field(vol, "read_only", bool, False),
                        "retained": _field(vol, "retained", bool, True)})
        points = [v["mount_point"] for v in out]
        if len(set(points)) != len(points):
            raise _invalid("configure: two volumes share a mount point")
        return out

    async def _configure(self, ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
        parsed = self._parse_config(_field(msg, "config", dict))
        async with self._config_lock:
            actions: list[str] = []
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(None, self._apply_config, parsed, actions)
            except AgentError as e:
                raise AgentError(e.code, e.message, {"actions": actions}) from None
            except OSError as e:
                raise AgentError("internal", f"configure: {e}", {"actions": actions}) from None
            if "env" in parsed and parsed["env"] != self.env_defaults:
                self.env_defaults = parsed["env"]
                actions.append(f"set {len(parsed['env'])} environment default(s)")
            old_retained = self.config.get("retained_filesystems")
            if parsed.get("retained_filesystems", old_retained) != old_retained:
                actions.append("set retained file systems")
            self.config = {**self.config, **parsed}
            canonical = json.dumps(self.config, sort_keys=True, separators=(",", ":"))
            self.config_digest = "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
        return {"changed": bool(actions), "actions": actions, "config_digest": self.config_digest}

    def retained(self) -> list[str]:
        vols = [v["mount_point"] for v in self.config.get("volumes", []) if v["retained"]]
        return sorted(set(self.config.get("retained_filesystems", [])) | set(vols))

    def _apply_config(self, cfg: dict[str, Any], actions: list[str]) -> None:
        if "hostname" in cfg:
            self._apply_hostname(cfg["hostname"], actions)
        if "dns" in cfg:
            dns = cfg["dns"]
            text = "# written by kibotos-guest\n" + "".join(
                f"nameserver {ns}\n" for ns in dns["nameservers"])
            text += f"search {' '.join(dns['search'])}\n" if dns["search"] else ""
            text += f"options {' '.join(dns['options'])}\n" if dns["options"] else ""
            path = self.path("/etc/resolv.conf")
            if os.path.islink(path) or _read_text(path) != text:
                atomic_write(path, text.encode())
                actions.append("wrote /etc/resolv.conf")
        for vol in cfg.get("volumes", []):
            self._apply_volume(vol, actions)

    def _apply_hostname(self, name: str, actions: list[str]) -> None:
        if self.root == "/" and socket.gethostname() != name:
            socket.sethostname(name)
            actions.append(f"set hostname {name}")
        path = self.path("/etc/hostname")
        if _read_text(path) != name + "\n":
            atomic_write(path, (name + "\n").encode())
            actions.append("wrote /etc/hostname")
        path = self.path("/etc/hosts")
        old = _read_text(path)
        lines = (old or "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")
        rows = lines.splitlines()
        ours = f"127.0.1.1\t{name}\t{_HOSTS_MARK}"
        marked = [i for i, row in enumerate(rows) if row.endswith(_HOSTS_MARK)]
        if marked:
            rows[marked[0]] = ours
            rows = [r for i, r in enumerate(rows) if i not in marked[1:]]
        else:
            rows.append(ours)
        new = "\n".join(rows) + "\n"
        if new != old:
            atomic_write(path, new.encode())
            actions.append("wrote /etc/hosts")

    def _apply_volume(self, vol: dict[str, Any], actions: list[str]) -> None:
        target = self.path(vol["mount_point"])
        rdev = os.stat(vol["device"]).st_rdev
        entry = mount_at(os.path.realpath(target))
        if entry is not None:
            if entry.dev == (os.major(rdev), os.minor(rdev)):
                return  # already there: configure is idempotent
            raise AgentError("failed_precondition", f"configure: {vol['mount_point']} already "
                             f"has {entry.source} ({entry.fs_type}) mounted")
        os.makedirs(target, mode=0o755, exist_ok=True)
        try:
            sys_mount(vol["device"], os.path.realpath(target), vol["fs_type"],
                      1 if vol["read_only"] else 0, vol["options"])  # 1: MS_RDONLY
        except OSError as e:
            raise AgentError("failed_precondition", f"configure: mounting {vol['device']} on "
                             f"{vol['mount_point']} failed: {e.strerror}") from None
        actions.append(f"mounted {vol['device']} on {vol['mount_point']} ({vol['fs_type']})")

    # -- stopping

    async def _stop_prepare(self, ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
        """End managed processes by the deadline, then sync and freeze retained file systems.

        Sync and freeze run even after a missed deadline (the stragglers were killed), so
        data already written is protected whatever the outcome; the first failure names
        the reason.  After a failure the frozen file systems stay frozen.
        """
        timeout = _seconds_field(msg, "timeout")
        sync_timeout = _seconds_field(msg, "sync_timeout", 30.0)
        raw = _field(msg, "filesystems", list, None)
        paths = self.retained() if raw is None else [
            _guest_path(p, "stop_prepare: filesystem") for p in raw]
        self.stopping = True
        ended, killed, survivors = await self._end_managed(timeout)
        failures: list[dict[str, str]] = []
        if killed:
            names = ", ".join(f"{pid} ({killed[pid]})" for pid in sorted(killed))
            text = (f"{len(killed)} managed process(es) did not end within {timeout:g}s of "
                    f"SIGTERM and were killed: {names}")
            if survivors:
                text += f"; still present after SIGKILL: {', '.join(map(str, sorted(survivors)))}"
            failures.append({"reason": "deadline_exceeded", "message": text})
        synced, sync_failed = await self._sync_filesystems(paths, sync_timeout)
        if sync_failed:
            failures.append({"reason": "retained filesystem sync failed",
                             "message": "; ".join(sync_failed)})
        frozen, freeze_failed = await self._freeze_filesystems(paths, sync_timeout)
        if freeze_failed:
            failures.append({"reason": "retained filesystem freeze failed",
                             "message": "; ".join(freeze_failed)})
        result = {"ended": sorted(ended), "killed": sorted(killed), "synced": synced,
                  "frozen": frozen}
        if failures:
            first = failures[0]
            code = "deadline_exceeded" if first["reason"] == "deadline_exceeded" else "internal"
            raise AgentError(code, f"{first['reason']}: {first['message']}",
                             {"reason": first["reason"], "failures": failures, **result})
        return result

    async def _end_managed(self, timeout: float) -> (
        tuple[set[int], dict[int, str], dict[int, str]]
    ):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        signalled: set[int] = set()
        ended: set[int] = set()
        current = self.members()
        while current:
            for pid in current.keys() - signalled:  # latecomers forked meanwhile get it too
                for sig in (signal.SIGTERM, signal.SIGCONT):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
                signalled.add(pid)
            ended |= current.keys()
            if loop.time() >= deadline:
                break
            await asyncio.sleep(min(0.05, max(0.0, deadline - loop.time())))
            current = self.members()
        killed = dict(current)
        grace = loop.time() + _KILL_GRACE
        while current and loop.time() < grace:
            for pid in current:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed.update(current)
            await asyncio.sleep(0.05)
            current = self.members()
        return ended - killed.keys(), killed, current

    def _mount_point(self, guest_path: str) -> str:
        real = os.path.realpath(self.path(guest_path))
        if mount_at(real) is None:
            raise OSError(errno.EINVAL, "not a mount point")
        return real

    async def _sync_filesystems(self, paths: list[str], timeout: float) -> (
        tuple[list[str], list[str]]
    ):
        loop = asyncio.get_running_loop()
        synced, failed = [], []
        for path in paths:
            if path in self.frozen:
                synced.append(path)
                continue
            try:
                work = loop.run_in_executor(None, _syncfs_path, self._mount_point(path))
                work.add_done_callback(_consume)
                await asyncio.wait_for(asyncio.shield(work), timeout)
                synced.append(path)
            except TimeoutError:
                failed.append(f"{path}: no answer within {timeout:g}s")
            except OSError as e:
                failed.append(f"{path}: {e.strerror or e}")
        return synced, failed

    async def _freeze_filesystems(self, paths: list[str], timeout: float) -> (
        tuple[list[str], list[str]]
    ):
        loop = asyncio.get_running_loop()
        failed = []
        for path in paths:
            if path in self.frozen:
                continue
            try:
                work = loop.run_in_executor(None, _freeze_path, self._mount_point(path))
                # A freeze that finishes after we stopped waiting is still recorded, so that
                # hello reports it and thaw undoes it.
                work.add_done_callback(functools.partial(self._record_freeze, path))
                await asyncio.wait_for(asyncio.shield(work), timeout)
            except TimeoutError:
                failed.append(f"{path}: no answer within {timeout:g}s")
            except OSError as e:
                why = "freezing is not supported" if e.errno == errno.EOPNOTSUPP else e.strerror
                failed.append(f"{path}: {why or e}")
        return sorted(p for p in paths if p in self.frozen), failed

    def _record_freeze(self, path: str, work: asyncio.Future[int]) -> None:
        if work.cancelled() or work.exception() is not None:
            return
        if path in self.frozen:
            os.close(work.result())
        else:
            self.frozen[path] = work.result()

    async def _sync(self, ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
        timeout = _seconds_field(msg, "timeout", 10.0)
        try:
            work = asyncio.get_running_loop().run_in_executor(None, os.sync)
            work.add_done_callback(_consume)
            await asyncio.wait_for(asyncio.shield(work), timeout)
        except TimeoutError:
            raise AgentError("deadline_exceeded", f"sync did not finish in {timeout:g}s") from None
        return {"synced": True}

    def _thaw(self, ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
        thawed, failed = [], []
        for path, fd in sorted(self.frozen.items()):
            try:
                fcntl.ioctl(fd, FITHAW, 0)
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: not frozen (any more)
                    failed.append(f"{path}: {e.strerror}")
                    continue
            os.close(fd)
            del self.frozen[path]
            thawed.append(path)
        if failed:
            raise AgentError("internal", f"thaw failed: {'; '.join(failed)}", {"thawed": thawed})
        self.stopping = False
        return {"thawed": thawed}


# ---------------------------------------------------------------------------- serving


def _open_device(path: str) -> int:
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    if os.isatty(fd):
        tty.setraw(fd)
    return fd


async def _wait_for_device(describe: str, find: Callable[[], str | None]) -> tuple[str, int]:
    """Open the channel device once it exists: the port appears after the module loads."""
    started = time.monotonic()
    last_log = started
    while True:
        path = find()
        if path is not None:
            try:
                return path, _open_device(path)
            except OSError as e:
                if e.errno != errno.ENOENT and time.monotonic() - last_log >= 10:
                    log.warning("opening %s: %s; retrying", path, e)
                    last_log = time.monotonic()
        if time.monotonic() - last_log >= 10:
            log.warning("still waiting for %s after %.0fs", describe, time.monotonic() - started)
            last_log = time.monotonic()
        await asyncio.sleep(0.1)


def _listen(agent: Agent, path: str) -> socket.socket:
    if os.path.exists(path) and stat.S_ISSOCK(os.stat(path).st_mode):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(16)
    sock.setblocking(False)
    counter = 0

    def accept() -> None:
        nonlocal counter
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            return
        counter += 1
        agent.add_channel(Channel(agent, f"connection {counter}", conn.detach(),
                                  reconnectable=False))

    asyncio.get_running_loop().add_reader(sock.fileno(), accept)
    return sock


async def serve(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    agent = Agent(root=args.root, protocol_version=args.advertise_protocol_version)
    loop.add_signal_handler(signal.SIGCHLD, agent.reap)
    stop = asyncio.Event()
    if os.getpid() != 1:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    listener = None
    if args.socket:
        listener = _listen(agent, args.socket)
        log.info("listening on %s", args.socket)
    elif args.fd is not None:
        agent.stop_when_idle = stop
        agent.add_channel(Channel(agent, f"fd {args.fd}", args.fd, reconnectable=False))
    else:
        wanted: list[tuple[str, Callable[[], str | None]]] = [
            (f"virtio-serial port {name}",
             functools.partial(find_port_device, name, args.sysfs, args.dev_dir))
            for name in args.port_name
        ]
        if args.device:
            wanted = [(args.device, functools.partial(str, args.device))]
        for describe, find in wanted:
            path, fd = await _wait_for_device(describe, find)
            log.info("serving %s on %s", describe, path)
            agent.add_channel(Channel(agent, path, fd, reconnectable=True))
    loop.add_signal_handler(signal.SIGCHLD, agent.reap)
    agent.reap()  # children that ended before the handler was in place
    await stop.wait()
    if listener is not None:
        loop.remove_reader(listener.fileno())
        listener.close()
    agent.shutdown()


def _init_as_pid1() -> None:
    """As PID 1 nothing mounted the kernel's file systems for us."""
    for target, fs_type in (("/proc", "proc"), ("/sys", "sysfs"), ("/dev", "devtmpfs")):
        if not os.path.ismount(target):
            try:
                os.makedirs(target, exist_ok=True)
                sys_mount(fs_type, target, fs_type, 0, "")
            except OSError as e:
                log.warning("mounting %s: %s", target, e)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kibotos-guest", description="kibotos guest agent")
    p.add_argument("--port-name", action="append", metavar="NAME",
                   help=f"virtio-serial port to serve (repeatable; default {DEFAULT_PORT_NAME})")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--device", metavar="PATH", help="serve this character device instead")
    where.add_argument("--socket", metavar="PATH", help="listen on a unix socket (tests)")
    where.add_argument("--fd", type=int, metavar="N", help="serve an inherited descriptor")
    p.add_argument("--root", default="/", metavar="DIR",
                   help="resolve /etc files and mount points under DIR (tests)")
    p.add_argument("--sysfs", default="/sys/class/virtio-ports", help=argparse.SUPPRESS)
    p.add_argument("--dev-dir", default="/dev", help=argparse.SUPPRESS)
    p.add_argument("--advertise-protocol-version", type=int, default=PROTOCOL_VERSION,
                   help=argparse.SUPPRESS)  # tests of the host's version check
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    args.port_name = args.port_name or [DEFAULT_PORT_NAME]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=args.log_level.upper(),
                        format="%(asctime)s kibotos-guest %(levelname)s %(message)s")
    if os.getpid() != 1:
        try:  # orphans of processes we start come back to us, so we can reap and end them
            _libc_call("prctl", _PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        except OSError as e:
            log.warning("cannot become a child subreaper: %s", e)
        asyncio.run(serve(args))
        return 0
    _init_as_pid1()
    while True:  # PID 1 must never exit: the kernel would panic
        try:
            asyncio.run(serve(args))
        except Exception:
            log.exception("agent failed; restarting in 1 s")
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
