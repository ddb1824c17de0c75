"""exec through a data plane (in this process) to the real guest agent on a unix socket."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import trio
from dp_harness import (
    INSTANCE_ID,
    NODE_ID,
    TIMEOUT,
    Plane,
    in_process_plane,
    run_exec,
    running_agent,
    target,
)

from kibotos.core.credentials import LIFETIME, SigningKey
from kibotos.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from kibotos.dataplane.clients.client import ExecClient, Output, Started, open_exec
from kibotos.dataplane.endpoints.exec_session import ExecRequest
from kibotos.dataplane.process.control import control_call
from kibotos.dataplane.process.state import Target, state_message
from kibotos.testing.waiting import wait_until


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[0]
    except OSError:
        return False
    return state != b"Z"


async def test_stdout_stderr_stdin_and_exit_code(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            assert await plane.hand_state(target(agent)) == {
                "generation": 1, "version": 1, "targets": 1}
            result = await run_exec(plane, ["sh", "-c", "echo out; echo err >&2; cat; exit 3"],
                                    stdin=b"from stdin\n")
            assert (result.stdout, result.stderr) == (b"out\nfrom stdin\n", b"err\n")
            assert result.status.exit_code == 3
            assert result.status.returncode == 3
            assert isinstance(result.pid, int)


async def test_environment_working_directory_and_large_stdin(tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 5)  # several guest windows and WebSocket frames
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            result = await run_exec(plane, ["sh", "-c", 'echo "$GREETING $(pwd)"'],
                                    env={"GREETING": "hello"}, cwd=str(tmp_path))
            assert result.stdout == f"hello {tmp_path}\n".encode()
            result = await run_exec(plane, ["cat"], stdin=data)
            assert result.stdout == data
            assert result.status.exit_code == 0


async def test_signal_from_the_client_and_death_by_signal(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            sent = []

            async def interrupt(ex: ExecClient, out: bytes) -> None:
                if b"ready" in out and not sent:
                    sent.append(True)
                    await ex.signal("TERM")

            result = await run_exec(plane, ["sh", "-c", "echo ready; sleep 300"],
                                    during=interrupt)
            assert result.status.exit_code is None
            assert result.status.signal == signal.SIGTERM
            assert result.status.signal_name in ("TERM", "SIGTERM")
            assert result.status.returncode == 128 + signal.SIGTERM
            # The signal went to the group: the sleep did not outlive the shell.
            assert result.pid is not None
            assert not pid_alive(result.pid)

            result = await run_exec(plane, ["sh", "-c", "kill -KILL $$"])
            assert result.status.signal == signal.SIGKILL
            assert result.status.returncode == 137


async def test_tty_with_resize(tmp_path: Path) -> None:
    script = ("test -t 0 && test -t 1 && echo is-a-tty; stty size; "
              "read line; stty size; echo got $line")
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            seen = b""
            with trio.fail_after(TIMEOUT):
                async with open_exec(plane.url, plane.credential(),
                                     ExecRequest(("sh", "-c", script), tty=True, rows=30,
                                                 cols=100)) as ex:
                    resized = False
                    async for event in ex.events():
                        if isinstance(event, Output):
                            assert event.stream == 1  # a tty has one output stream
                            seen += event.data
                            if b"30 100" in seen and not resized:
                                resized = True
                                await ex.resize(40, 120)
                                await ex.send_stdin(b"hello\n")
            text = seen.decode()
            assert "is-a-tty" in text
            assert text.index("30 100") < text.index("40 120") < text.index("got hello")
            assert ex.exit is not None
            assert ex.exit.exit_code == 0


async def test_tty_eof_ends_cat(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            with trio.fail_after(TIMEOUT):
                async with open_exec(plane.url, plane.credential(),
                                     ExecRequest(("cat",), tty=True)) as ex:
                    await ex.send_stdin(b"abc\n")
                    out = b""
                    async for event in ex.events():
                        if isinstance(event, Output):
                            out += event.data
                            if out.count(b"abc") == 2:  # the echo and cat's copy
                                await ex.close_stdin()
            assert ex.exit is not None
            assert ex.exit.exit_code == 0


async def test_client_that_goes_away_hangs_up_its_process(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            with trio.fail_after(TIMEOUT):
                async with open_exec(plane.url, plane.credential(),
                                     ExecRequest(("sleep", "300"))) as ex:
                    async for event in ex.events():
                        if isinstance(event, Started):
                            break
                    pid = ex.pid
                    assert pid is not None
                    assert pid_alive(pid)
            await wait_until(lambda: not pid_alive(pid), "the process to be hung up")
            assert plane.server is not None
            await wait_until(lambda: "kibotos_dataplane_exec_hung_up_total 1.0"
                             in plane.server.metrics.text(), "the hang-up to be counted")


async def test_concurrent_execs_share_one_guest_channel(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            results: dict[int, bytes] = {}

            async def one(i: int) -> None:
                res = await run_exec(plane, ["sh", "-c", f"sleep 0.2; echo {i}"])
                results[i] = res.stdout

            async with trio.open_nursery() as nursery:
                for i in range(6):
                    nursery.start_soon(one, i)
            assert results == {i: f"{i}\n".encode() for i in range(6)}
            assert plane.server is not None
            assert plane.server.guests.open_count() == 1


async def test_exec_errors_come_back_as_errors(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            with pytest.raises(NotFound, match="no-such-program"):
                await run_exec(plane, ["no-such-program"])
            with pytest.raises(NotFound):
                await run_exec(plane, ["true"], cwd="/no/such/dir")
            with pytest.raises(InvalidArgument, match="env name"):
                await run_exec(plane, ["true"], env={"BAD NAME": "x"})
            with pytest.raises(InvalidArgument, match="argv"):
                await run_exec(plane, [])
            # The data plane is still fine afterwards.
            assert (await run_exec(plane, ["echo", "ok"])).stdout == b"ok\n"


async def refused(plane: Plane, credential: str) -> None:
    await run_exec(plane, ["true"], credential=credential)


async def test_bad_credentials_are_refused_before_anything_runs(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            with pytest.raises(Unavailable, match="not been given its state"):
                await refused(plane, plane.credential())
            await plane.hand_state(target(agent))
            good = plane.credential()
            head, tail = good.split(".")
            # Change the signature's first character (the last ones carry padding bits,
            # and may already be the replacement).
            flipped = ("B" if tail[0] == "A" else "A") + tail[1:]
            with pytest.raises(Unauthenticated, match="does not verify"):
                await refused(plane, f"{head}.{flipped}")
            with pytest.raises(Unauthenticated, match="does not verify"):
                await refused(plane, plane.credential(key=SigningKey.generate()))
            with pytest.raises(Unauthenticated, match="expired"):
                await refused(plane, plane.credential(now=trio_wall() - LIFETIME - 120))
            with pytest.raises(PermissionDenied, match="node-b"):
                await refused(plane, plane.credential(node_id="node-b"))
            with pytest.raises(NotFound, match="inst-2"):
                await refused(plane, plane.credential(instance_id="inst-2"))
            with pytest.raises(PermissionDenied, match="does not belong"):
                await refused(plane, plane.credential(workspace_id="ws-other"))
            with pytest.raises(Unauthenticated, match="malformed"):
                await refused(plane, "not-a-credential")
            assert plane.server is not None
            text = plane.server.metrics.text()
            assert 'kibotos_dataplane_connections_rejected_total{code="unauthenticated"} 4.0' \
                in text
            assert "kibotos_dataplane_exec_started_total 0.0" in text
            assert (await run_exec(plane, ["true"], credential=good)).status.exit_code == 0


def trio_wall() -> float:
    import time

    return time.time()


async def test_missing_authorization_header_and_unknown_path(tmp_path: Path) -> None:
    async with in_process_plane(tmp_path) as plane:
        request = ExecRequest(("true",))
        with pytest.raises(Unavailable, match="not been given its state"):
            async with open_exec(plane.url, None, request):
                pass
        await plane.hand_state()
        with pytest.raises(Unauthenticated, match="missing session credential"):
            async with open_exec(plane.url, None, request):
                pass
        with pytest.raises(NotFound, match="no such data-plane endpoint: /v2/v1/exec"):
            async with open_exec(plane.url + "/v2", plane.credential(), request):
                pass


async def test_unreachable_guest_is_unavailable_and_a_restarted_agent_is_reached(
        tmp_path: Path) -> None:
    async with in_process_plane(tmp_path) as plane:
        assert plane.server is not None
        plane.server.guests.connect_timeout = 1.0
        missing = Target(INSTANCE_ID, tmp_path / "agent-dp.sock", "ws-1")
        await plane.hand_state(missing)
        with pytest.raises(Unavailable, match="cannot be reached"):
            await run_exec(plane, ["true"])
        with running_agent(tmp_path) as agent:
            assert (await run_exec(plane, ["echo", "1"])).stdout == b"1\n"
        # The agent is gone: the channel ended, and the next exec says so.
        with pytest.raises(Unavailable):
            await run_exec(plane, ["true"])
        with running_agent(tmp_path) as agent:
            assert agent.socket == missing.agent_socket
            assert (await run_exec(plane, ["echo", "2"])).stdout == b"2\n"


async def test_state_handover_rules(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path, generation=4) as plane:
            await plane.hand_state(target(agent))
            old_key = plane.key
            # A bad state is refused naming the field, and the old one stays in force.
            for message, pattern in (
                    ({"targets": {"inst-1": {"agent_socket": "relative"}}}, "absolute"),
                    ({"public_key": "nope"}, "public_key"),
                    ({"node_id": "Bad_Node"}, "node_id"),
                    ({"extra": 1}, "unknown keys"),
                    ({"targets": {"x" * 40: {"agent_socket": "/a"}}}, "instance ID")):
                body = {**state_message(4, NODE_ID, old_key.public_key, [target(agent)]),
                        **message}
                with pytest.raises(InvalidArgument, match=pattern):
                    await control_call(plane.control, body)
            with pytest.raises(FailedPrecondition, match="generation 3"):
                await control_call(plane.control, state_message(
                    3, NODE_ID, old_key.public_key, [target(agent)]))
            assert (await run_exec(plane, ["true"])).status.exit_code == 0
            # A new key replaces the old one at once.
            plane.key = SigningKey.generate()
            await plane.hand_state(target(agent))
            with pytest.raises(Unauthenticated):
                await refused(plane, plane.credential(key=old_key))
            assert (await run_exec(plane, ["true"])).status.exit_code == 0
            # A target that leaves the state is refused, and its channel is closed.
            await plane.hand_state()
            with pytest.raises(NotFound):
                await refused(plane, plane.credential())
            assert plane.server is not None
            assert plane.server.guests.open_count() == 0
            status = await control_call(plane.control, {"type": "status"})
            assert status["generation"] == 4
            assert status["version"] == 3  # refused states do not count
            assert status["has_state"] is True
            assert status["listen"] == plane.listen
            with pytest.raises(InvalidArgument, match="unknown control request"):
                await control_call(plane.control, {"type": "reboot"})


async def test_a_guest_that_does_not_start_the_process_in_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kibotos.dataplane.endpoints import exec_session

    monkeypatch.setattr(exec_session, "START_TIMEOUT", 1.0)
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            assert (await run_exec(plane, ["true"])).status.exit_code == 0  # channel open
            os.kill(agent.proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(Unavailable, match="did not start the process within 1s"):
                    await run_exec(plane, ["sleep", "300"])
            finally:
                os.kill(agent.proc.pid, signal.SIGCONT)
            # The guest catches up; the late process is killed, and exec works again.
            assert (await run_exec(plane, ["echo", "back"])).stdout == b"back\n"
            await wait_until(lambda: not any(
                "sleep 300" in _cmdline(pid) for pid in _children(agent.proc.pid)),
                "the late process to be killed")


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_bytes().rpartition(b")")[2].split()
            except OSError:
                continue
            if int(stat[1]) == pid and stat[0] != b"Z":
                out.append(int(entry))
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_a_target_with_a_vsock_port_round_trips_and_a_bad_port_is_refused(
        tmp_path: Path) -> None:
    from kibotos.core.credentials import SigningKey as Key
    from kibotos.dataplane.process.state import parse_state

    key = Key.generate().public_key
    sock = tmp_path / "agent-dp.sock"
    vsock = Target(INSTANCE_ID, sock, "ws-1", 1024)
    plain = Target("inst-2", sock)
    message = state_message(1, NODE_ID, key, [vsock, plain])
    assert message["targets"][INSTANCE_ID] == {"agent_socket": str(sock),
                                               "workspace_id": "ws-1", "vsock_port": 1024}
    state = parse_state(message, generation=1, version=1)
    assert state.targets[INSTANCE_ID] == vsock
    assert state.targets["inst-2"] == plain
    for bad in (0, -1, 2**32 - 1, "1024", True):
        body = state_message(1, NODE_ID, key, [plain])
        body["targets"]["inst-2"]["vsock_port"] = bad
        with pytest.raises(InvalidArgument, match="vsock_port must be a port number"):
            parse_state(body, generation=1, version=1)
