"""The real guest agent run on the host, and helpers the guest tests share.

The agent runs under Debian's own ``/usr/bin/python3`` when there is one (what a guest
image carries: standard library only, none of the venv's packages), listening on a unix
socket, with ``--root`` pointing its /etc files and mount points at a temporary tree.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import trio

from kibotos.guest import AGENT_PATH, GuestChannel, connect_unix_with_retry, open_guest_channel
from kibotos.testing.waiting import wait_until as wait_until  # re-exported for tests/guest

GUEST_PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
TIMEOUT = 60  # generous: machines are noisy


class AgentProcess:
    """One agent subprocess; `prefix` wraps it (e.g. in ``unshare``)."""

    def __init__(self, tmp_path: Path, *extra: str, prefix: tuple[str, ...] = ()) -> None:
        self.socket = tmp_path / "agent.sock"
        self.root = tmp_path / "root"
        self.root.mkdir(exist_ok=True)
        self.log = tmp_path / "agent.log"
        argv = [*prefix, GUEST_PYTHON, str(AGENT_PATH), "--socket", str(self.socket),
                "--root", str(self.root), "--log-level", "DEBUG", *extra]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=log)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def status_kib(self, field: str) -> int:
        """A memory figure (``VmRSS``, ``VmHWM``) of the agent, in KiB."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise KeyError(field)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.asynccontextmanager
async def connected(agent: AgentProcess) -> AsyncIterator[GuestChannel]:
    """A client channel to `agent`, after its hello."""
    stream = await connect_unix_with_retry(agent.socket, trio.current_time() + TIMEOUT)
    async with open_guest_channel(stream) as guest:
        await guest.wait_hello(trio.current_time() + TIMEOUT)
        yield guest


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != b"Z"


def run(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def read_text(path: str | Path) -> str:
    return Path(path).read_text()


def ppid_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[1])


def spawn(*argv: str, **kwargs: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, **kwargs)  # type: ignore[call-overload,no-any-return]


@contextlib.contextmanager
def ext4_loop(tmp_path: Path, name: str = "vol", size: str = "64M") -> Iterator[str]:
    """A fresh ext4 image on a loop device; yields the device path.

    Cleanup thaws and unmounts anything still mounted from the device (a failed test
    may leave it frozen), then detaches it.
    """
    image = tmp_path / f"{name}.img"
    run("truncate", "-s", size, str(image))
    run("mkfs.ext4", "-q", "-F", str(image))
    device = run("losetup", "--find", "--show", str(image)).strip()
    try:
        yield device
    finally:
        rdev = os.stat(device).st_rdev
        wanted = f"{os.major(rdev)}:{os.minor(rdev)}"
        for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
            fields = line.split()
            if fields[2] == wanted:
                subprocess.run(["fsfreeze", "--unfreeze", fields[4]], capture_output=True,
                               check=False)
                subprocess.run(["umount", fields[4]], check=False)
        subprocess.run(["losetup", "-d", device], check=False)
