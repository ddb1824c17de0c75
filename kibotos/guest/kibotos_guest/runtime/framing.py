"""The frames of the guest protocol: a 24-byte header, then the payload.

Both ends use this module (the host imports it as ``kibotos.guest.kibotos_guest.runtime.framing``),
so they cannot drift apart.  The layout is in docs/guest-protocol.md, "Framing".

`Frame` and `FrameError` are small slotted classes rather than dataclasses: importing
`dataclasses` pulls in `inspect` and `ast`, which cost a noticeable part of the agent's
start in a TCG guest.
"""

from __future__ import annotations

import binascii
import json
import struct

from ..errors import invalid

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

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


class Frame:
    """One decoded frame (immutable by convention; compared and hashed by value)."""

    __slots__ = ("flags", "kind", "payload", "stream")

    def __init__(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        self.kind = kind
        self.flags = flags
        self.stream = stream
        self.payload = payload

    def _key(self) -> tuple[int, int, int, bytes]:
        return (self.kind, self.flags, self.stream, self.payload)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Frame) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (f"Frame(kind={self.kind!r}, flags={self.flags!r}, stream={self.stream!r}, "
                f"payload={self.payload!r})")


class FrameError:
    """Bytes that are not a valid frame; the decoder has already resynchronised."""

    __slots__ = ("message", "stream")

    def __init__(self, message: str, stream: int | None = None) -> None:
        self.message = message
        self.stream = stream

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, FrameError) and self.message == other.message
                and self.stream == other.stream)

    def __hash__(self) -> int:
        return hash((self.message, self.stream))

    def __repr__(self) -> str:
        return f"FrameError(message={self.message!r}, stream={self.stream!r})"


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
            # One copy through a view: slicing the bytearray first would copy twice
            # (and allocate a second buffer as large as the payload).
            with memoryview(buf) as view:
                payload = bytes(view[HEADER_SIZE : HEADER_SIZE + length])
            del buf[: HEADER_SIZE + length]
            self._in_garbage = False
            if binascii.crc32(payload) != pcrc:
                out.append(FrameError("frame payload checksum mismatch; frame dropped", stream))
                continue
            out.append(Frame(kind, flags, stream, payload))
        return out


def credited(window: int, amount: int, stream_id: int) -> int:
    """A stream's send window after the peer's ``window`` message of `amount`: more than
    `MAX_WINDOW` outstanding is the peer's protocol error."""
    if window + amount > MAX_WINDOW:
        raise invalid(f"window: credit for stream {stream_id} exceeds {MAX_WINDOW}")
    return window + amount
