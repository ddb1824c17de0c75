"""The agent as a package: its launcher, what it imports before hello, its command line,
and its event loop.  The protocol itself is tested by the other files here."""

from __future__ import annotations

import ast
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest
from guest_harness import GUEST_PYTHON, TIMEOUT, spawn

from kibotos.guest import AGENT_PACKAGE_DIR, AGENT_PATH
from kibotos.guest.kibotos_guest import cli
from kibotos.guest.kibotos_guest.runtime import loop as gloop
from kibotos.guest.kibotos_guest.runtime import tasks
from kibotos.guest.kibotos_guest.runtime.framing import KIND_CONTROL, Frame, FrameDecoder

MODULES = sorted(AGENT_PACKAGE_DIR.rglob("*.py"))

#: Modules the agent must not import on the way to its first hello: each costs tens to
#: hundreds of milliseconds in a TCG guest, and none is needed before a request.
HEAVY = {"asyncio", "logging", "argparse", "dataclasses", "typing", "subprocess", "ctypes",
         "threading", "secrets", "hashlib", "ipaddress", "inspect", "ssl", "shutil", "pwd",
         "termios", "tty", "socket", "contextlib"}


def test_every_module_is_small_and_imports_only_the_standard_library() -> None:
    assert len(MODULES) >= 10
    assert len(AGENT_PATH.read_text().splitlines()) < 80  # the launcher stays a launcher
    assert {p.parent.name for p in MODULES} == {"kibotos_guest", "runtime", "services"}
    for path in MODULES:
        source = path.read_text()
        assert len(source.splitlines()) <= 400, f"{path.name} is over 400 lines"
        # A relative import stays inside the package (it is copied alone to the guest).
        depth = len(path.relative_to(AGENT_PACKAGE_DIR).parts)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif isinstance(node, ast.ImportFrom):
                assert node.level <= depth, f"{path.name} imports from outside the package"
                continue
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names, f"{path.name} imports {name}"


def _hello_over_socketpair(*python_flags: str) -> tuple[dict[str, object], str]:
    """Start the agent on one end of a socketpair, read its hello, hang up; return the
    hello and the agent's stderr."""
    ours, theirs = socket.socketpair()
    proc = spawn(GUEST_PYTHON, *python_flags, str(AGENT_PATH), "--fd", str(theirs.fileno()),
                 "--root", "/nonexistent", pass_fds=[theirs.fileno()],
                 stderr=subprocess.PIPE, env={"PATH": os.environ["PATH"]})
    theirs.close()
    try:
        ours.settimeout(TIMEOUT)
        decoder = FrameDecoder()
        frames: list[object] = []
        while not frames:
            data = ours.recv(65536)
            assert data, "the agent hung up before its hello"
            frames = decoder.feed(data)
        ours.close()  # with --fd the agent exits when the host hangs up
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    first = frames[0]
    assert isinstance(first, Frame)
    assert first.kind == KIND_CONTROL
    import json

    return json.loads(first.payload), err.decode(errors="replace")


def test_the_launcher_runs_isolated_from_any_directory() -> None:
    """``python3 -I agent.py``: no script directory on sys.path, no environment; the
    launcher finds its package itself (the test VMM starts it this way)."""
    hello, err = _hello_over_socketpair("-I")
    assert hello["type"] == "hello"
    assert "Traceback" not in err


def test_nothing_heavy_is_imported_before_hello() -> None:
    _, err = _hello_over_socketpair("-X", "importtime")
    # importtime lines are written as each import finishes; everything up to the log
    # line that follows the hello was needed to get there.
    # Python's own start (site) comes first; it is not the agent's doing.
    before_hello = err.split("kibotos-guest INFO fd ")[0].split("| site\n", 1)[1]
    imported = {line.rsplit("|", 1)[1].strip() for line in before_hello.splitlines()
                if line.startswith("import time:") and "|" in line}
    assert "kibotos_guest.cli" in imported
    assert not imported & HEAVY, sorted(imported & HEAVY)
    assert not {"kibotos_guest.configure", "kibotos_guest.stop"} & imported


# ---------------------------------------------------------------------------- command line


@pytest.mark.parametrize("argv", [
    [],
    ["--port-name", "org.kibotos.agent.0"],
    ["--port-name=a", "--port-name", "b", "--log-level", "debug"],
    ["--socket", "/tmp/x.sock", "--root", "/tmp/r"],
    ["--socket=/tmp/x.sock", "--socket", "/tmp/y.sock"],
    ["--fd", "7", "--advertise-protocol-version=0"],
    ["--vsock", "1024"],
    ["--device", "/dev/vport0p1", "--sysfs", "/s", "--dev-dir", "/d"],
])
def test_the_plain_parser_agrees_with_argparse(argv: list[str]) -> None:
    plain = cli._parse_plain(argv)
    assert plain is not None
    assert vars(plain) == vars(cli._argparse(argv))


@pytest.mark.parametrize(("argv", "message"), [
    (["--socket", "/a", "--device", "/b"], "not allowed with argument"),
    (["--vsock", "1024", "--socket", "/b"], "not allowed with argument"),
    (["--vsock", "port"], "invalid int value"),
    (["--fd", "seven"], "invalid int value"),
    (["--log-level", "chatty"], "unknown log level 'chatty'"),
    (["--bogus"], "unrecognized arguments"),
    (["--socket"], "expected one argument"),
])
def test_bad_command_lines_get_argparse_errors(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli._parse_plain(argv) is None
    with pytest.raises(SystemExit) as caught:
        cli.parse_args(argv)
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


def test_abbreviations_and_help_still_work() -> None:
    assert cli._parse_plain(["--sock", "/x"]) is None
    assert cli.parse_args(["--sock", "/x"]).socket == "/x"
    out = subprocess.run([GUEST_PYTHON, str(AGENT_PATH), "--help"], capture_output=True,
                         text=True, timeout=TIMEOUT, check=True).stdout
    assert "--port-name NAME" in out


# ---------------------------------------------------------------------------- loop


def test_wait_for_times_out_without_cancelling_the_work() -> None:
    release = threading.Event()
    seen: list[object] = []

    async def main() -> str:
        work = tasks.run_in_thread(lambda: release.wait(TIMEOUT) and "late result")
        work.add_done_callback(lambda done: seen.append(done.result()))
        with pytest.raises(TimeoutError):
            await tasks.wait_for(work, 0.05)
        release.set()
        return str(await work)

    assert gloop.Loop().run(main()) == "late result"
    assert seen == ["late result"]


def test_thread_exceptions_reach_the_awaiting_coroutine() -> None:
    def fail() -> None:
        raise OSError(5, "Input/output error")

    async def main() -> int | None:
        try:
            await tasks.run_in_thread(fail)
        except OSError as e:
            return e.errno
        return None

    assert gloop.Loop().run(main()) == 5


def test_a_failing_callback_is_logged_and_the_loop_goes_on(
        capsys: pytest.CaptureFixture[str]) -> None:
    def boom() -> None:
        raise ValueError("callback bug")

    async def main() -> str:
        gloop.get_loop().call_soon(boom)
        await tasks.sleep(0.01)
        return "still running"

    assert gloop.Loop().run(main()) == "still running"
    err = capsys.readouterr().err
    assert "exception in callback" in err
    assert "ValueError: callback bug" in err


def test_lock_is_first_come_first_served_and_timers_run_in_order() -> None:
    order: list[str] = []

    async def main() -> None:
        lock = tasks.Lock()

        async def user(name: str, hold: float) -> None:
            async with lock:
                order.append(f"{name} in")
                await tasks.sleep(hold)
                order.append(f"{name} out")

        users = [tasks.create_task(user(n, 0.02)) for n in "abc"]
        for task in users:
            await task
        loop = gloop.get_loop()
        done = tasks.Event()
        loop.call_later(0.03, order.append, "t3")
        loop.call_later(0.01, order.append, "t1")
        cancelled = loop.call_later(0.02, order.append, "never")
        cancelled.cancel()
        loop.call_later(0.05, done.set)
        await done.wait()

    gloop.Loop().run(main())
    assert order == ["a in", "a out", "b in", "b out", "c in", "c out", "t1", "t3"]


def test_signals_run_as_callbacks_and_handlers_are_restored() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    got: list[str] = []

    async def main() -> None:
        loop = gloop.get_loop()
        done = tasks.Event()

        def on_signal() -> None:
            got.append("signalled")
            done.set()

        loop.add_signal_handler(signal.SIGUSR1, on_signal)
        loop.call_later(TIMEOUT, done.set)  # fail below rather than hang
        os.kill(os.getpid(), signal.SIGUSR1)
        await done.wait()

    gloop.Loop().run(main())
    assert got == ["signalled"]
    assert signal.getsignal(signal.SIGUSR1) == before
    assert signal.set_wakeup_fd(-1) == -1  # the loop put the previous one (none) back


def test_removed_readers_do_not_run() -> None:
    """Two readable pipes; the first callback removes the other's reader and closes it:
    the other callback must not run in the same iteration (asyncio's guarantee)."""
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    os.write(w1, b"x")
    os.write(w2, b"y")
    ran: list[int] = []

    async def main() -> None:
        loop = gloop.get_loop()

        def first(me: int, other: int) -> None:
            ran.append(me)
            loop.remove_reader(me)
            loop.remove_reader(other)

        loop.add_reader(r1, lambda: first(r1, r2))
        loop.add_reader(r2, lambda: first(r2, r1))
        await tasks.sleep(0.05)

    gloop.Loop().run(main())
    assert len(ran) == 1
    for fd in (r1, w1, r2, w2):
        os.close(fd)
