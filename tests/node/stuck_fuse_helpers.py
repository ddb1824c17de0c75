"""`stuck_fuse.py` run as a child process, for the tests of VMM processes stuck in the
kernel (an uninterruptible wait on a file system that does not answer)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import trio

HERE = Path(__file__).resolve().parent
DEADLINE = 120


class StuckFs:
    """Mounts the never-answering file system at `mountpoint` until `release`."""

    def __init__(self, mountpoint: Path) -> None:
        self.mountpoint = mountpoint
        self.proc = subprocess.Popen([sys.executable, str(HERE / "stuck_fuse.py"),
                                      str(mountpoint)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self._line() == "ready"

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    async def wait_held(self) -> None:
        """A lookup is held: some process now waits in the kernel."""
        with trio.fail_after(DEADLINE):
            line = await trio.to_thread.run_sync(self._line)
        assert line.startswith("held "), line

    def release(self) -> None:
        """Answer every held request (the waiting processes go on), unmount, exit."""
        assert self.proc.stdin is not None
        if not self.proc.stdin.closed:
            self.proc.stdin.close()
        self.proc.wait(timeout=DEADLINE)
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            self.proc.stdout.close()
