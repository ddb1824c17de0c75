"""`GuestOutputStream.receive_some` hands on what piled up as one piece (the relay above
pays per piece), never more than asked, and grants credit for exactly what it returned.
The stream is fed as the channel's reader feeds it; the host records the credit."""

from __future__ import annotations

import json
from typing import Any

from kibotos.guest.kibotos_guest.runtime.framing import DATA_CHUNK
from kibotos.guest.streams import RECEIVE_COALESCE, GuestOutputStream


class RecordingHost:
    """Keeps the frames the stream sends (its window grants)."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def _send_nowait(self, frame: bytes) -> None:
        self.frames.append(frame)

    async def _request(self, kind: str, fields: dict[str, Any]) -> dict[str, Any]:
        raise AssertionError("an output stream makes no requests")

    def granted(self) -> int:
        total = 0
        for frame in self.frames:
            body = json.loads(frame[frame.index(b"{"):frame.rindex(b"}") + 1])
            total += body["bytes"]
        return total


def frames(count: int) -> list[bytes]:
    return [bytes([i]) * DATA_CHUNK for i in range(count)]


async def test_buffered_frames_come_out_joined_up_to_the_limit() -> None:
    host = RecordingHost()
    stream = GuestOutputStream(host, 1, 16 * DATA_CHUNK)
    sent = frames(6)
    for frame in sent:
        stream._feed(frame, eof=False)
    stream._feed(b"", eof=True)
    first = await stream.receive_some()
    assert len(first) == RECEIVE_COALESCE == 4 * DATA_CHUNK
    second = await stream.receive_some()
    assert first + second == b"".join(sent)
    assert await stream.receive_some() == b""


async def test_max_bytes_is_honoured_across_and_within_frames() -> None:
    host = RecordingHost()
    stream = GuestOutputStream(host, 1, 4 * DATA_CHUNK)
    sent = frames(3)
    for frame in sent:
        stream._feed(frame, eof=False)
    pieces = [await stream.receive_some(DATA_CHUNK + 10), await stream.receive_some(10),
              await stream.receive_some(5 * DATA_CHUNK)]
    assert [len(p) for p in pieces] == [DATA_CHUNK, 10, 2 * DATA_CHUNK - 10]
    assert b"".join(pieces) == b"".join(sent)
    # every byte returned was granted back to the guest (in grants of a quarter window)
    assert host.granted() == 3 * DATA_CHUNK
