"""``kibotos dataplane serve`` as a real process: SIGTERM drain, refusals at start."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from dp_harness import TIMEOUT, PlaneProcess, run_exec, running_agent, target

from kibotos.core.credentials import SigningKey
from kibotos.core.errors import Unavailable
from kibotos.dataplane.clients.client import Output, Started, open_exec
from kibotos.dataplane.endpoints.exec_session import ExecRequest
from kibotos.dataplane.process.control import control_call


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[0]
    except OSError:
        return False
    return state != b"Z"


async def wait_exit(proc: subprocess.Popen[bytes]) -> int:
    with trio.fail_after(TIMEOUT):
        while proc.poll() is None:
            await trio.sleep(0.05)
    return proc.returncode


async def test_sigterm_closes_what_is_left_after_the_drain(tmp_path: Path) -> None:
    key = SigningKey.generate()
    dp = PlaneProcess(tmp_path, generation=2, drain_timeout=2.0)
    try:
        with running_agent(tmp_path) as agent:
            await dp.wait_serving()
            plane = dp.plane(key)
            await plane.hand_state(target(agent))
            assert (await run_exec(plane, ["echo", "hi"])).stdout == b"hi\n"
            with trio.fail_after(TIMEOUT):
                async with open_exec(plane.url, plane.credential(),
                                     ExecRequest(("sleep", "300"))) as ex:
                    event = await ex.next_event()
                    assert isinstance(event, Started)
                    pid = ex.pid
                    assert pid is not None
                    assert pid_alive(pid)
                    dp.proc.send_signal(signal.SIGTERM)
                    with pytest.raises(Unavailable, match="1001 data plane stopping"):
                        await ex.next_event()
            assert await wait_exit(dp.proc) == 0
            log = dp.log_text()
            assert "data plane stopping signal=SIGTERM connections=1 drain_timeout=2s" in log
            assert ("data plane stopped generation=2 open_at_stop=1 ended_on_their_own=0 "
                    "closed=1") in log
            with trio.fail_after(TIMEOUT):
                while pid_alive(pid):  # the guest process was hung up
                    await trio.sleep(0.05)
    finally:
        dp.stop()


async def test_sigterm_stops_accepting_and_lets_open_connections_finish(
        tmp_path: Path) -> None:
    key = SigningKey.generate()
    dp = PlaneProcess(tmp_path, drain_timeout=120.0)
    try:
        with running_agent(tmp_path) as agent:
            await dp.wait_serving()
            plane = dp.plane(key)
            await plane.hand_state(target(agent))
            with trio.fail_after(TIMEOUT):
                async with open_exec(plane.url, plane.credential(),
                                     ExecRequest(("cat",))) as ex:
                    assert isinstance(await ex.next_event(), Started)
                    dp.proc.send_signal(signal.SIGTERM)
                    # Once the listener is closed, a new connection is refused ...
                    while True:
                        try:
                            with socket.create_connection(("127.0.0.1",
                                                           int(dp.listen.split(":")[1]))):
                                pass
                        except ConnectionRefusedError:
                            break
                        await trio.sleep(0.05)
                    with pytest.raises(Unavailable, match="cannot reach"):
                        await run_exec(plane, ["true"])
                    # ... while the open one still works, and the control socket answers.
                    status = await control_call(plane.control, {"type": "status"})
                    assert status["draining"] is True
                    assert status["connections"] == 1
                    await ex.send_stdin(b"still here\n")
                    await ex.close_stdin()
                    out = b""
                    async for event in ex.events():
                        if isinstance(event, Output):
                            out += event.data
                    assert out == b"still here\n"
                    assert ex.exit is not None
                    assert ex.exit.exit_code == 0
            # It ended on its own, so the process leaves without waiting out the drain.
            assert await wait_exit(dp.proc) == 0
            assert "open_at_stop=1 ended_on_their_own=1 closed=0" in dp.log_text()
    finally:
        dp.stop()


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kibotos.cli.main", "dataplane", "serve",
                           *args], capture_output=True, text=True, timeout=TIMEOUT,
                          check=False)


def test_cli_refuses_a_bad_listen_address_and_a_busy_port(tmp_path: Path) -> None:
    done = run_cli("--listen", "nowhere", "--socket-dir", str(tmp_path), "--generation", "1")
    assert done.returncode == 10, done.stderr
    assert "listen address must be host:port" in done.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = run_cli("--listen", f"127.0.0.1:{port}", "--socket-dir", str(tmp_path),
                       "--generation", "1")
    assert done.returncode == 17, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    done = run_cli("--listen", "127.0.0.1:0", "--socket-dir", str(tmp_path),
                   "--generation", "0")
    assert done.returncode == 2
    help_text = subprocess.run([sys.executable, "-m", "kibotos.cli.main", "dataplane",
                                "serve", "--help"], capture_output=True, text=True,
                               check=True).stdout
    assert "[default: 10.0" in help_text


def test_cli_serves_plain_only_on_loopback(tmp_path: Path) -> None:
    done = run_cli("--listen", "0.0.0.0:0", "--socket-dir", str(tmp_path), "--generation",
                   "1", "--plain")
    assert done.returncode == 10, done.stderr
    assert "plain HTTP only on a loopback address" in done.stderr
