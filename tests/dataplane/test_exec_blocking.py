"""``kibo workspace exec``'s own client end: `kibotos.dataplane.clients.exec_blocking` (a socket
and wsproto) and the one-thread loop of `kibotos.cli.workspace.exec_relay`, against a real data
plane (in this process) and the real guest agent on a unix socket.

The relay runs as a process of its own (exec_relay_driver.py), so stdin, stdout,
stderr and signals are real descriptors and real signals, as for ``kibo``.  The
blocking client's error paths are called in a worker thread.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import trio
from dp_harness import TIMEOUT, Plane, free_port, in_process_plane, running_agent, target

from kibotos.core.errors import NotFound, Unauthenticated, Unavailable
from kibotos.dataplane.clients import exec_blocking
from kibotos.dataplane.clients.exec_wire import ExecRequest, Output

DRIVER = Path(__file__).with_name("exec_relay_driver.py")


def driver_argv(plane: Plane, argv: list[str], **options: object) -> list[str]:
    return [sys.executable, str(DRIVER), plane.url, plane.credential(), json.dumps(options),
            "--", *argv]


async def relay(plane: Plane, argv: list[str], *, stdin: bytes = b"",
                **options: object) -> trio.CompletedProcess[bytes]:
    with trio.fail_after(TIMEOUT):
        return await trio.run_process(driver_argv(plane, argv, **options), stdin=stdin,
                                      capture_stdout=True, capture_stderr=True,
                                      check=False)


async def test_streams_stdin_environment_and_exit_code(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            done = await relay(plane, ["sh", "-c", "echo out; echo err >&2; cat; exit 3"],
                               stdin=b"from stdin\n")
            assert (done.returncode, done.stdout, done.stderr) == (
                3, b"out\nfrom stdin\n", b"err\n")
            done = await relay(plane, ["sh", "-c", 'echo "$GREETING $(pwd)"'],
                               env={"GREETING": "hello"}, cwd=str(tmp_path))
            assert (done.returncode, done.stdout) == (0, f"hello {tmp_path}\n".encode())
            done = await relay(plane, ["sh", "-c", "kill -TERM $$"])
            assert done.returncode == 128 + signal.SIGTERM
            done = await relay(plane, ["no-such-program"])
            assert done.returncode == 12
            assert b"error: not_found: " in done.stderr
            assert b"no-such-program" in done.stderr


async def test_a_large_file_through_cat_and_stdin_from_dev_null(tmp_path: Path) -> None:
    """Input from a regular file (poll finds it always readable) that is far larger
    than what the data plane takes at once, echoed back while it is still being sent:
    neither direction may wait for the other."""
    data = os.urandom(8 * 1024 * 1024 + 3)
    (tmp_path / "in").write_bytes(data)
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            src = os.open(tmp_path / "in", os.O_RDONLY)
            dst = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                with trio.fail_after(TIMEOUT):
                    done = await trio.run_process(driver_argv(plane, ["cat"]), stdin=src,
                                                  stdout=dst, capture_stderr=True,
                                                  check=False)
            finally:
                os.close(src)
                os.close(dst)
            assert done.returncode == 0, done.stderr
            assert (tmp_path / "out").read_bytes() == data
            null = os.open(os.devnull, os.O_RDONLY)
            try:
                with trio.fail_after(TIMEOUT):
                    done = await trio.run_process(driver_argv(plane, ["wc", "-c"]),
                                                  stdin=null, capture_stdout=True,
                                                  check=False)
            finally:
                os.close(null)
            assert (done.returncode, done.stdout.strip()) == (0, b"0")


async def _start(plane: Plane, argv: list[str], **options: object) -> tuple[
        trio.Process, trio.lowlevel.FdStream]:
    read_fd, write_fd = os.pipe()
    proc = await trio.lowlevel.open_process(driver_argv(plane, argv, **options),
                                            stdin=subprocess.DEVNULL,
                                            stdout=write_fd)
    os.close(write_fd)
    return proc, trio.lowlevel.FdStream(read_fd)


async def _read_until(stream: trio.lowlevel.FdStream, needle: bytes) -> bytes:
    seen = b""
    with trio.fail_after(TIMEOUT):
        while needle not in seen:
            chunk = await stream.receive_some()
            assert chunk, seen
            seen += chunk
    return seen


async def test_signals_are_forwarded_and_the_third_interrupt_leaves(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            proc, out = await _start(plane, ["sh", "-c",
                                             'trap "echo got INT; exit 5" INT; echo ready; '
                                             'while :; do sleep 0.1; done'])
            async with out:
                await _read_until(out, b"ready")
                proc.send_signal(signal.SIGINT)
                await _read_until(out, b"got INT")
                with trio.fail_after(TIMEOUT):
                    assert await proc.wait() == 5

            # A process that ignores SIGINT: the third one makes the relay leave, and
            # the data plane hangs the process up.
            marker = tmp_path / "hung-up"
            proc, out = await _start(plane, ["sh", "-c",
                                             f'trap "" INT; trap "touch {marker}; exit" HUP; '
                                             'echo ready; while :; do sleep 0.1; done'])
            async with out:
                await _read_until(out, b"ready")
                for _ in range(3):
                    proc.send_signal(signal.SIGINT)
                    await trio.sleep(0.2)  # three separate deliveries, not one
                with trio.fail_after(TIMEOUT):
                    assert await proc.wait() == 128 + signal.SIGINT
            with trio.fail_after(TIMEOUT):
                while not marker.exists():
                    await trio.sleep(0.05)


async def test_the_global_timeout_hangs_the_process_up(tmp_path: Path) -> None:
    marker = tmp_path / "hung-up"
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            done = await relay(plane, ["sh", "-c", f'trap "touch {marker}; exit" HUP; '
                                       'while :; do sleep 0.1; done'], timeout=1.0)
            assert done.returncode == 16
            assert b"deadline_exceeded" in done.stderr
            with trio.fail_after(TIMEOUT):
                while not marker.exists():
                    await trio.sleep(0.05)


def _run_blocking(url: str, credential: str | None, argv: tuple[str, ...]) -> bytes:
    """Connect and read to the exit without the relay (no stdin): the stdout."""
    import select

    ex = exec_blocking.connect(url, credential, ExecRequest(argv))
    out = bytearray()
    try:
        ex.close_stdin()
        while ex.exit is None:
            ex.check_open()
            select.select([ex], [ex] if ex.wants_write else [], [], TIMEOUT)
            ex.flush()
            for event in ex.receive():
                if isinstance(event, Output):
                    out += event.data
        assert ex.exit.returncode == 0
        assert isinstance(ex.pid, int)
        return bytes(out)
    finally:
        ex.close()


async def test_the_blocking_client_and_its_errors(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))

            async def call(*args: object) -> bytes:
                with trio.fail_after(TIMEOUT):
                    return await trio.to_thread.run_sync(partial(_run_blocking, *args))

            assert await call(plane.url, plane.credential(), ("echo", "hi")) == b"hi\n"
            with pytest.raises(Unauthenticated):
                await call(plane.url, None, ("true",))
            with pytest.raises(NotFound):  # no such endpoint: the upgrade is refused
                await call(plane.url + "/v2", plane.credential(), ("true",))
            with pytest.raises(NotFound, match="no-such-program"):  # an error frame
                await call(plane.url, plane.credential(), ("no-such-program",))
            nowhere = f"http://127.0.0.1:{free_port()}"
            with pytest.raises(Unavailable, match="cannot reach the data plane"):
                await call(nowhere, plane.credential(), ("true",))
