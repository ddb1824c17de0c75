"""exec through the real agent: streams, exit codes, signals, ttys, concurrency, memory."""

from __future__ import annotations

import os
import signal
import statistics
from pathlib import Path

import pytest
import trio
from guest_harness import (
    GUEST_PYTHON,
    TIMEOUT,
    AgentProcess,
    pid_alive,
    ppid_of,
    read_text,
    wait_until,
)

from kibotos.core.errors import FailedPrecondition, InvalidArgument, NotFound
from kibotos.guest import (
    AGENT_VERSION,
    PROTOCOL_VERSION,
    ExitStatus,
    GuestChannel,
    GuestOutputStream,
)


async def read_until(stream: GuestOutputStream, needle: bytes) -> bytes:
    seen = b""
    with trio.fail_after(TIMEOUT):
        while needle not in seen:
            chunk = await stream.receive_some()
            assert chunk, f"EOF before {needle!r}; got {seen!r}"
            seen += chunk
    return seen


async def test_hello_carries_boot_id_version_and_capabilities(
    guest: GuestChannel, agent: AgentProcess
) -> None:
    info = guest.hello
    assert info is not None
    assert info.boot_id == read_text("/proc/sys/kernel/random/boot_id").strip()
    assert info.protocol_version == PROTOCOL_VERSION == 1
    assert info.agent_version == AGENT_VERSION
    assert info.pid == agent.pid
    assert {"exec", "exec.tty", "signal", "configure.volumes", "stop_prepare",
            "freeze", "sync", "thaw"} <= info.capabilities
    assert info.to_json()["capabilities"] == sorted(info.capabilities)
    assert await guest.guest_info() == info
    assert await guest.ping() >= 0


async def test_exec_streams_stdout_stderr_and_exit_code(guest: GuestChannel) -> None:
    status, out, err = await guest.run(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (status, out, err) == (ExitStatus(3), b"out\n", b"err\n")
    assert status.returncode == 3


async def test_stdin_round_trip_of_several_windows(guest: GuestChannel) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)
    status, out, _ = await guest.run(["cat"], input=data)
    assert status.exit_code == 0
    assert out == data


async def test_exec_environment_and_working_directory(guest: GuestChannel,
                                                      tmp_path: Path) -> None:
    status, out, _ = await guest.run(["sh", "-c", 'echo "$A|$PATH|$(pwd)"'],
                                     env={"A": "1"}, cwd=str(tmp_path))
    assert status.exit_code == 0
    a, path, cwd = out.decode().strip().split("|")
    assert (a, cwd) == ("1", str(tmp_path))
    assert "/usr/bin" in path.split(":")
    # The agent's own environment does not leak into processes.
    os.environ["KIBOTOS_TEST_LEAK"] = "x"
    _, out, _ = await guest.run(["sh", "-c", "echo ${KIBOTOS_TEST_LEAK:-absent}"])
    assert out == b"absent\n"


async def test_exec_failures_are_clear_errors(guest: GuestChannel) -> None:
    with pytest.raises(NotFound, match="no-such-program"):
        await guest.exec(["no-such-program"])
    with pytest.raises(NotFound, match="/no/such/dir"):
        await guest.exec(["true"], cwd="/no/such/dir")
    with pytest.raises(InvalidArgument, match="argv"):
        await guest.exec([])
    with pytest.raises(InvalidArgument, match="on_detach"):
        await guest.exec(["true"], on_detach="sometimes")
    status, _, _ = await guest.run(["true"])  # the channel is still fine
    assert status.exit_code == 0


async def test_signal_and_exit_by_signal(guest: GuestChannel) -> None:
    proc = await guest.exec(["sleep", "100"])
    await proc.signal("TERM")
    status = await proc.wait()
    assert (status.exit_code, status.signal, status.signal_name) == (None, 15, "SIGTERM")
    assert status.returncode == 128 + 15
    with pytest.raises(FailedPrecondition, match="already exited"):
        await proc.signal("KILL")


async def test_signal_to_the_process_group(guest: GuestChannel) -> None:
    proc = await guest.exec(["sh", "-c", "sleep 100 & echo $!; wait"])
    assert proc.stdout is not None
    child = int((await read_until(proc.stdout, b"\n")).decode())
    assert pid_alive(child)
    await proc.signal(signal.SIGTERM, group=True)
    assert (await proc.wait()).signal == signal.SIGTERM
    await wait_until(lambda: not pid_alive(child), "the background child to end")


async def test_tty_exec_with_window_size_resize_and_input(guest: GuestChannel) -> None:
    proc = await guest.exec(["sh", "-c", "tty; stty size; read line; stty size; echo got:$line"],
                            tty=True, rows=30, cols=100)
    assert proc.stdout is not None
    assert proc.stdin is not None
    assert proc.stderr is None
    seen = await read_until(proc.stdout, b"30 100")
    assert b"/dev/pts/" in seen
    await proc.resize(50, 120)
    await proc.stdin.send_all(b"hello\n")
    rest = await proc.stdout.read_all()
    assert b"50 120" in rest
    assert b"got:hello" in rest
    assert (await proc.wait()).exit_code == 0


async def test_tty_stdin_close_sends_eof(guest: GuestChannel) -> None:
    proc = await guest.exec(["cat"], tty=True)
    assert proc.stdin is not None
    assert proc.stdout is not None
    await proc.stdin.send_all(b"line\n")
    await read_until(proc.stdout, b"line\r\nline\r\n")  # the echo, then cat's copy
    await proc.stdin.aclose()
    assert (await proc.wait()).exit_code == 0


async def test_many_concurrent_execs(guest: GuestChannel) -> None:
    results: dict[int, tuple[int | None, bytes]] = {}

    async def one(i: int) -> None:
        status, out, _ = await guest.run(["sh", "-c", "echo $0; cat", str(i)],
                                         input=f"in{i}".encode())
        results[i] = (status.exit_code, out)

    with trio.fail_after(TIMEOUT * 2):
        async with trio.open_nursery() as nursery:
            for i in range(64):
                nursery.start_soon(one, i)
    assert results == {i: (0, f"{i}\nin{i}".encode()) for i in range(64)}
    assert guest.statistics().open_processes == 0


async def test_large_output_is_flow_controlled(guest: GuestChannel,
                                               agent: AgentProcess) -> None:
    size = 50 * 1024 * 1024
    await guest.run(["true"])  # warm up the agent's code paths before the baseline
    baseline = agent.status_kib("VmHWM")
    proc = await guest.exec(["head", "-c", str(size), "/dev/zero"])
    assert proc.stdout is not None
    # Read nothing for a while: a producer that is not held back would pile 50 MB up in
    # the agent now.  Then read it all, slowly at first.
    await trio.sleep(1)
    stalled = agent.status_kib("VmRSS")
    total = 0
    with trio.fail_after(TIMEOUT * 2):
        async for chunk in proc.stdout:
            total += len(chunk)
            if total < 4 * 1024 * 1024:
                await trio.sleep(0.001)
        status = await proc.wait()
    assert status.exit_code == 0
    assert total == size
    grown = agent.status_kib("VmHWM") - baseline
    assert stalled - baseline < 16 * 1024, f"agent grew {stalled - baseline} KiB while stalled"
    assert grown < 16 * 1024, f"agent peak memory grew by {grown} KiB for a 50 MB stream"


async def test_orphans_are_reaped(guest: GuestChannel, agent: AgentProcess) -> None:
    _, out, _ = await guest.run(["sh", "-c", "sleep 0.5 & echo $!"])
    orphan = int(out)
    if pid_alive(orphan):  # still sleeping: it was handed to the agent, a subreaper
        assert ppid_of(orphan) == agent.pid
    # Gone entirely, not a zombie waiting for a wait().
    await wait_until(lambda: not Path(f"/proc/{orphan}").exists(), "the orphan to be reaped")


@pytest.mark.root
async def test_exec_as_another_user_drops_root_groups(guest: GuestChannel) -> None:
    status, out, _ = await guest.run(["sh", "-c", "id -u; id -g; id -G"], uid=65534)
    assert status.exit_code == 0
    uid, gid, groups = out.decode().split("\n")[:3]
    assert uid == "65534"
    assert "0" not in groups.split()
    assert gid != "0"


async def test_exec_round_trip_latency(guest: GuestChannel) -> None:
    """Measures `true` over the unix socket; prints it (run with -s), asserts nothing timed."""
    samples = []
    for _ in range(20):
        await guest.run(["true"])
    for _ in range(200):
        start = trio.current_time()
        status, _, _ = await guest.run(["true"])
        samples.append(trio.current_time() - start)
        assert status.exit_code == 0
    pings = [await guest.ping() for _ in range(200)]
    print(f"\nexec `true` round trip over a unix socket: median "
          f"{statistics.median(samples) * 1000:.2f} ms, p90 "
          f"{statistics.quantiles(samples, n=10)[-1] * 1000:.2f} ms; ping median "
          f"{statistics.median(pings) * 1000:.3f} ms")


#: Starts the agent with hang-ups and terminations ignored, as `nohup` or a careless
#: service manager would.
IGNORING_STARTER = (
    GUEST_PYTHON, "-c", "import os, signal, sys; "
    "[signal.signal(s, signal.SIG_IGN) for s in (signal.SIGHUP, signal.SIGTERM)]; "
    "os.execv(sys.argv[1], sys.argv[1:])")


async def test_processes_start_with_default_signals_whatever_the_agent_inherited(
        tmp_path: Path) -> None:
    from guest_harness import connected

    agent = AgentProcess(tmp_path, prefix=IGNORING_STARTER)
    try:
        async with connected(agent) as guest:
            status, out, _ = await guest.run(["grep", "SigIgn", "/proc/self/status"])
        assert status.exit_code == 0
        ignored = int(out.split()[1], 16)
        for sig in (signal.SIGHUP, signal.SIGTERM):
            assert not ignored & (1 << (sig - 1)), f"{sig.name} ignored: {out!r}"
    finally:
        agent.stop()
