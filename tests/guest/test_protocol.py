"""The wire itself: framing, malformed input, reconnects, versions, and the transports."""

from __future__ import annotations

import json
import os
import pty
import signal
import socket
import subprocess
import tty
from pathlib import Path
from typing import Any

import pytest
import trio
from guest_harness import (
    GUEST_PYTHON,
    TIMEOUT,
    AgentProcess,
    connected,
    pid_alive,
    spawn,
    wait_until,
)

from kibotos.core.errors import DeadlineExceeded, FailedPrecondition
from kibotos.guest import (
    AGENT_PATH,
    GuestProtocolUnsupported,
    connect_unix_with_retry,
    open_guest_channel,
)
from kibotos.guest.agent import (
    HEADER_SIZE,
    KIND_CONTROL,
    KIND_DATA,
    MAX_PAYLOAD,
    Frame,
    FrameDecoder,
    FrameError,
    encode_control,
    encode_data,
    encode_frame,
    find_port_device,
)

# ---------------------------------------------------------------------------- decoder


def test_frames_round_trip_even_byte_by_byte() -> None:
    wire = encode_control({"type": "ping", "id": 1}) + encode_data(7, b"x" * 1000, eof=True)
    decoder = FrameDecoder()
    frames = [f for b in wire for f in decoder.feed(bytes([b]))]
    assert frames == [Frame(KIND_CONTROL, 0, 0, b'{"type":"ping","id":1}'),
                      Frame(KIND_DATA, 1, 7, b"x" * 1000)]
    assert decoder.buffered() == 0


def test_zero_padding_is_skipped_silently() -> None:
    frame = encode_control({"type": "ping", "id": 1})
    assert FrameDecoder().feed(bytes(100) + frame + bytes(HEADER_SIZE + MAX_PAYLOAD)) == [
        Frame(KIND_CONTROL, 0, 0, b'{"type":"ping","id":1}')]


def test_garbage_is_reported_once_then_the_next_frame_is_found() -> None:
    frame = encode_control({"type": "ping", "id": 2})
    out = FrameDecoder().feed(b"garbage" * 50 + frame[:3] + b"!" + frame)
    assert [type(x) for x in out] == [FrameError, Frame]
    assert isinstance(out[1], Frame)
    assert out[1].payload == b'{"type":"ping","id":2}'


def test_a_magic_split_across_reads_is_kept() -> None:
    frame = encode_control({"type": "ping", "id": 3})
    decoder = FrameDecoder()
    assert decoder.feed(b"junk" + frame[:2]) == [FrameError("bytes that are not a frame")]
    assert decoder.feed(frame[2:]) == [Frame(KIND_CONTROL, 0, 0, b'{"type":"ping","id":3}')]


def test_corrupt_headers_and_payloads_are_rejected() -> None:
    good = encode_data(5, b"hello")
    parsed = Frame(KIND_DATA, 0, 5, b"hello")
    bad_header = bytearray(good)
    bad_header[18] ^= 0xFF  # the payload checksum field: the header checksum catches it
    out = FrameDecoder().feed(bytes(bad_header) + good)
    assert out == [FrameError("frame header checksum mismatch"), parsed]

    bad_payload = bytearray(good)
    bad_payload[-1] ^= 0xFF
    out = FrameDecoder().feed(bytes(bad_payload) + good)
    assert out == [FrameError("frame payload checksum mismatch; frame dropped", 5), parsed]

    too_long = encode_data(6, b"123456")
    out = FrameDecoder(max_payload=4).feed(too_long + encode_data(5, b"hell"))
    assert out == [FrameError("invalid frame header (kind 2, length 6)"),
                   Frame(KIND_DATA, 0, 5, b"hell")]


def test_encoding_refuses_oversized_payloads() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        encode_frame(KIND_DATA, 1, bytes(MAX_PAYLOAD + 1))


def test_port_discovery_by_name(tmp_path: Path) -> None:
    sysfs = tmp_path / "virtio-ports"
    for entry, name in (("vport0p0", "org.qemu.guest_agent.0"),
                        ("vport1p1", "org.kibotos.agent.0")):
        (sysfs / entry).mkdir(parents=True)
        (sysfs / entry / "name").write_text(name + "\n")
    assert find_port_device("org.kibotos.agent.0", str(sysfs), "/dev") == "/dev/vport1p1"
    assert find_port_device("org.kibotos.agent.9", str(sysfs), "/dev") is None
    assert find_port_device("x", str(tmp_path / "absent")) is None


# ---------------------------------------------------------------------------- raw wire


class RawPeer:
    """A host that speaks frames by hand, to send what the client never would."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.decoder = FrameDecoder()
        self.pending: list[Frame | FrameError] = []

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def next_control(self) -> dict[str, Any]:
        with trio.fail_after(TIMEOUT):
            while True:
                while self.pending:
                    item = self.pending.pop(0)
                    assert isinstance(item, Frame), item
                    if item.kind == KIND_CONTROL:
                        msg: dict[str, Any] = json.loads(item.payload)
                        return msg
                data = await self.stream.receive_some()
                assert data, "agent closed the connection"
                self.pending.extend(self.decoder.feed(data))

    async def next_of(self, kind: str) -> dict[str, Any]:
        while True:
            msg = await self.next_control()
            if msg["type"] == kind:
                return msg


async def raw_peer(agent: AgentProcess) -> RawPeer:
    peer = RawPeer(await connect_unix_with_retry(agent.socket, trio.current_time() + TIMEOUT))
    assert (await peer.next_control())["type"] == "hello"
    return peer


async def test_malformed_input_is_answered_not_fatal(agent: AgentProcess) -> None:
    peer = await raw_peer(agent)

    await peer.send(b"this is not a frame at all")
    err = await peer.next_of("protocol_error")
    assert err["error"] == {"code": "invalid_argument", "message": "bytes that are not a frame"}

    await peer.send(encode_frame(KIND_CONTROL, 0, b"{not json"))
    assert "not JSON" in (await peer.next_of("protocol_error"))["error"]["message"]

    await peer.send(encode_control({"id": 5, "no": "type"}))
    err = await peer.next_of("protocol_error")
    assert err["id"] == 5
    assert "'type'" in err["error"]["message"]

    await peer.send(encode_control({"type": "ping"}))
    assert "integer 'id'" in (await peer.next_of("protocol_error"))["error"]["message"]

    await peer.send(encode_data(99, b"to nobody"))
    err = await peer.next_of("protocol_error")
    assert err["stream"] == 99

    corrupt = bytearray(encode_control({"type": "ping", "id": 6}))
    corrupt[-2] ^= 1
    await peer.send(bytes(corrupt))
    assert "checksum" in (await peer.next_of("protocol_error"))["error"]["message"]

    for rid, request, match in [
        (7, {"type": "reboot"}, "unknown request type 'reboot'"),
        (8, {"type": "exec", "argv": "ls"}, "'argv' has the wrong type"),
        (9, {"type": "exec", "argv": ["true"], "rows": 0}, "'rows' must be in 1..65535"),
        (10, {"type": "exec", "argv": ["true"], "stdout_stream": 3, "stderr_stream": 3},
         "distinct"),
        (11, {"type": "signal", "process": 12345, "signal": "TERM"}, "no running process"),
        (12, {"type": "stop_prepare", "timeout": -1}, "'timeout' must be in"),
        (13, {"type": "configure", "config": {"hostname": "x", "bogus": 1}}, "bogus"),
    ]:
        await peer.send(encode_control({**request, "id": rid}))
        reply = await peer.next_of("response")
        assert reply["id"] == rid
        assert match in reply["error"]["message"], reply
        assert reply["error"]["code"] in ("invalid_argument", "not_found")

    await peer.send(encode_control({"type": "ping", "id": 14}))
    reply = await peer.next_of("response")
    assert reply["id"] == 14
    assert "monotonic" in reply["result"]
    assert agent.proc.poll() is None
    await peer.stream.aclose()


async def test_reconnect_gets_a_fresh_hello_and_hangs_up_the_old_session(
    agent: AgentProcess,
) -> None:
    async with connected(agent) as guest:
        first = guest.hello
        sleeper = await guest.exec(["sleep", "1000"])
        assert pid_alive(sleeper.pid)
    async with connected(agent) as guest:
        second = guest.hello
        assert first is not None
        assert second is not None
        assert (second.boot_id, second.instance_id) == (first.boot_id, first.instance_id)
        await wait_until(lambda: not pid_alive(sleeper.pid), "SIGHUP to end the old process")
        _status, out, _ = await guest.run(["echo", "again"])
        assert out == b"again\n"


async def test_host_refuses_a_guest_outside_its_protocol_range(tmp_path: Path) -> None:
    agent = AgentProcess(tmp_path, "--advertise-protocol-version", "2")
    try:
        stream = await connect_unix_with_retry(agent.socket, trio.current_time() + TIMEOUT)
        async with open_guest_channel(stream) as guest:
            with pytest.raises(GuestProtocolUnsupported,
                               match=r"guest protocol version 2 is outside the range this "
                                     r"kibotos accepts \(1\)") as caught:
                await guest.wait_hello(trio.current_time() + TIMEOUT)
            assert caught.value.info.protocol_version == 2  # check-upgrade reads this
            assert isinstance(caught.value, FailedPrecondition)
            with pytest.raises(GuestProtocolUnsupported):
                await guest.exec(["true"])
            with pytest.raises(GuestProtocolUnsupported):
                await guest.guest_info()
        # The same guest is fine for a build that accepts version 2.
        stream = await connect_unix_with_retry(agent.socket, trio.current_time() + TIMEOUT)
        async with open_guest_channel(stream, accepted=(1, 2)) as guest:
            assert (await guest.wait_hello(trio.current_time() + TIMEOUT)).protocol_version == 2
    finally:
        agent.stop()


async def test_connect_retries_until_the_socket_listens(tmp_path: Path) -> None:
    path = tmp_path / "qemu.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))  # the file exists, but connecting is refused: like early QEMU
    with server:
        with pytest.raises(DeadlineExceeded, match="did not accept a connection"):
            await connect_unix_with_retry(path, trio.current_time() + 0.3)

        async def listen_later() -> None:
            await trio.sleep(0.3)
            server.listen(1)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(listen_later)
            stream = await connect_unix_with_retry(path, trio.current_time() + TIMEOUT)
            await stream.aclose()


async def test_no_hello_by_the_deadline(tmp_path: Path) -> None:
    a, b = trio.testing.memory_stream_pair()
    async with open_guest_channel(a) as guest:
        with pytest.raises(DeadlineExceeded, match="did not say hello"):
            await guest.wait_hello(trio.current_time() + 0.2)
    await b.aclose()


# ---------------------------------------------------------------------------- transports


async def test_inherited_descriptor_mode_exits_when_the_host_hangs_up(tmp_path: Path) -> None:
    ours, theirs = socket.socketpair()
    proc = spawn(GUEST_PYTHON, str(AGENT_PATH), "--fd", str(theirs.fileno()),
                 "--root", str(tmp_path), pass_fds=[theirs.fileno()], stderr=subprocess.PIPE)
    theirs.close()
    try:
        async with open_guest_channel(trio.SocketStream(trio.socket.from_stdlib_socket(ours))
                                      ) as guest:
            await guest.wait_hello(trio.current_time() + TIMEOUT)
            _, out, _ = await guest.run(["echo", "over a socketpair"])
            assert out == b"over a socketpair\n"
        assert proc.wait(TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate()
    assert b"Traceback" not in err, err.decode()


async def test_device_mode_over_a_tty(tmp_path: Path) -> None:
    """--device opens a character device once, read-write, and serves it (a pty here;
    a virtio-serial port in a guest)."""
    master, slave = pty.openpty()
    tty.setraw(slave)  # no line discipline between the ends from the first byte on
    proc = spawn(GUEST_PYTHON, str(AGENT_PATH), "--device", os.ttyname(slave),
                 "--root", str(tmp_path), stderr=subprocess.PIPE)
    try:
        async with open_guest_channel(trio.lowlevel.FdStream(master)) as guest:
            info = await guest.wait_hello(trio.current_time() + TIMEOUT)
            assert info.pid == proc.pid
            _, out, _ = await guest.run(["sh", "-c", "head -c 300000 /dev/zero | wc -c"])
            assert out.strip() == b"300000"
    finally:
        os.close(slave)
        proc.terminate()
        _, err = proc.communicate(timeout=TIMEOUT)
    assert b"Traceback" not in err, err.decode()


@pytest.mark.root
async def test_as_pid_1_it_reaps_orphans(tmp_path: Path) -> None:
    agent = AgentProcess(tmp_path, prefix=("unshare", "--pid", "--fork", "--kill-child",
                                           "--mount-proc"))
    try:
        async with connected(agent) as guest:
            assert guest.hello is not None
            assert guest.hello.pid == 1
            _, out, _ = await guest.run(["sh", "-c", "sleep 0.2 & echo $!"])
            orphan = int(out)  # a pid inside the namespace, handed to PID 1 when sh exits

            async def gone() -> bool:
                status, _, _ = await guest.run(["test", "-e", f"/proc/{orphan}"])
                return status.exit_code != 0

            with trio.fail_after(TIMEOUT):
                while not await gone():
                    await trio.sleep(0.05)
    finally:
        agent.stop(signal.SIGKILL)  # PID 1 ignores SIGTERM, and so does `unshare --fork`
    assert "Traceback" not in agent.log_text(), agent.log_text()
