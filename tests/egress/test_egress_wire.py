"""The egress control socket for real: JSON lines with descriptors in both directions,
malformed lines refused, and only root (or the process's own user) let in."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import trio

from kibotos.core.errors import FailedPrecondition, InvalidArgument
from kibotos.egress import wire
from kibotos.testing.accounts import ensure_system_user

#: An interpreter another user can run (the test venv's may live under /root).
OTHER_PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable


async def handler(message: wire.Message) -> wire.Message:
    kind = message.body["type"]
    if kind == "echo":
        return wire.Message({"got": message.body.get("value"), "count": len(message.fds)})
    if kind == "keep":  # take a socket, answer with a copy of it
        fds, message.fds = message.fds, []
        sock = socket.socket(fileno=fds[0])
        copy = os.dup(sock.fileno())
        sock.close()
        return wire.Message({"family": int(sock.family)}, [copy])
    raise FailedPrecondition(f"no {kind}")


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return wire.control_path(tmp_path, 1)


async def test_lines_and_descriptors_both_ways(path: Path):
    async with trio.open_nursery() as nursery:
        await nursery.start(wire.serve, path, handler)
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
        assert (await wire.call(path, {"type": "echo", "value": [1, "x"]})).body == \
            {"got": [1, "x"], "count": 0}
        a, b = socket.socketpair()
        with a, b:
            answer = await wire.call(path, {"type": "keep"}, [a.fileno()])
            assert answer.body == {"family": socket.AF_UNIX}
            assert len(answer.fds) == 1
            returned = socket.socket(fileno=answer.fds[0])
            with returned:
                returned.sendall(b"through the returned copy")
                assert b.recv(64) == b"through the returned copy"
        with pytest.raises(FailedPrecondition, match="no nothing"):
            await wire.call(path, {"type": "nothing"})
        with pytest.raises(InvalidArgument, match="string 'type'"):
            await wire.call(path, {"type": 7})
        nursery.cancel_scope.cancel()
    assert not await trio.to_thread.run_sync(os.path.lexists, path)


async def test_a_line_announcing_more_descriptors_than_came_is_refused(path: Path):
    async with trio.open_nursery() as nursery:
        await nursery.start(wire.serve, path, handler)
        for line, error in ((b'{"type":"echo","fds":2}\n', b"announces 2 descriptors, 0 "
                                                          b"arrived"),
                            (b"not json\n", b"not JSON")):
            with trio.fail_after(10):
                raw = await trio.open_unix_socket(str(path))
                async with raw:
                    await raw.send_all(line)
                    assert error in await raw.receive_some(4096)
        nursery.cancel_scope.cancel()


@pytest.mark.root
async def test_another_user_is_refused():
    account = ensure_system_user()
    # a directory others may enter: its permissions would keep them out, the test is of
    # the peer check behind them
    base = Path(tempfile.mkdtemp(prefix="kbt-wire-", dir="/tmp"))
    os.chmod(base, 0o755)
    path = wire.control_path(base, 1)
    async with trio.open_nursery() as nursery:
        await nursery.start(wire.serve, path, handler)
        os.chmod(path, 0o666)
        # the refusal comes before any request is read
        probe = ("import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]);"
                 "print(s.recv(4096).decode())")
        done = await trio.to_thread.run_sync(lambda: subprocess.run(
            [OTHER_PYTHON, "-c", probe, str(path)], capture_output=True, text=True, timeout=30,
            user=account.pw_uid, group=account.pw_gid, extra_groups=[]))
        assert "permission_denied" in done.stdout, done.stderr
        assert "only the node (root) talks to the egress process" in done.stdout
        nursery.cancel_scope.cancel()
    shutil.rmtree(base)
