"""Detached service processes of a dev cluster: start, identify, signal, stop.

The dev cluster starts ctrl and the nodes as real processes in their own sessions, so
they outlive the `kibotos dev cluster up` that started them and a Ctrl-C in its
terminal does not reach them.  A process is known by its PID file; before it is
signalled, `/proc/<pid>/cmdline` must still name the config file it was started with,
so a PID the kernel reused for something else is never killed.

When the starting process is still alive (the Python API in tests), it keeps the
`subprocess.Popen` handle: that reaps the child (no zombie is mistaken for a live
process) and gives its exit status.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kibotos.core import atomicfile, procfs

#: How long `stop` waits after SIGTERM before it sends SIGKILL.
DEFAULT_GRACE = 10.0
#: Begins the line `Supervisor.start` appends to a service's log before each start.
START_MARK = "--- kibotos dev: starting "
#: Set by systemd for the processes of a unit; never passed on to processes we start.
SERVICE_MANAGER_VARIABLES = ("INVOCATION_ID", "NOTIFY_SOCKET", "JOURNAL_STREAM",
                             "WATCHDOG_USEC", "WATCHDOG_PID", "MAINPID")


@dataclass(frozen=True)
class Service:
    """One long-running process of the cluster and the files that describe it."""

    name: str  # "ctrl" or a node ID
    argv: tuple[str, ...]
    config: Path  # its presence in /proc/<pid>/cmdline identifies the process
    log: Path
    pid_file: Path


def read_pid(pid_file: Path) -> int | None:
    """The PID recorded in `pid_file`, or None when there is none (or it is garbage)."""
    try:
        text = pid_file.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def cmdline(pid: int) -> list[str] | None:
    """The argument vector of `pid`; None when it does not exist or is a zombie."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    if not raw:  # zombies and kernel threads have an empty command line
        return None
    return [a.decode(errors="replace") for a in raw.rstrip(b"\0").split(b"\0")]


def is_ours(pid: int, service: Service) -> bool:
    """Whether `pid` is alive and still runs `service` (its config path and ``serve``)."""
    args = cmdline(pid)
    if args is None:
        return False
    return "serve" in args and str(service.config) in args


def _state(pid: int) -> str | None:
    """The one-letter state of `pid` from /proc/<pid>/stat; None if it does not exist."""
    stat = procfs.read_stat(pid)
    return stat.state if stat is not None else None


def is_stopped(pid: int) -> bool:
    """Whether `pid` is stopped by a signal (SIGSTOP): alive, but not answering."""
    return _state(pid) in ("T", "t")


def has_exited(pid: int, service: Service) -> bool:
    """Whether `pid` no longer runs `service` and has let go of its files.

    The command line empties early in the kernel's exit path, before the process's
    files (its listening socket, its lock file) are closed; only a zombie or a vanished
    PID has closed them, so a restart right after cannot trip over them."""
    state = _state(pid)
    if state is None or state in procfs.DEAD_STATES:
        return True
    args = cmdline(pid)
    if args is None:
        return False  # still exiting
    return not is_ours(pid, service)  # the PID now runs something else


class Supervisor:
    """Starts services detached and stops them again; holds the handles of its children."""

    def __init__(self) -> None:
        self._children: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, service: Service, env: Mapping[str, str] | None = None) -> int:
        """Start `service` in its own session, output appended to its log; return its PID."""
        service.log.parent.mkdir(parents=True, exist_ok=True)
        child_env = dict(os.environ)
        # Dev-cluster processes are started by hand, not as systemd units: a shell or CI
        # runner that is itself a service must not lend them its unit's identity.
        for inherited in SERVICE_MANAGER_VARIABLES:
            child_env.pop(inherited, None)
        child_env["PYTHONUNBUFFERED"] = "1"
        if env:
            child_env.update(env)
        with open(service.log, "ab") as log:
            log.write(f"{START_MARK}{time.strftime('%Y-%m-%d %H:%M:%S')}: "
                      f"{' '.join(service.argv)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                service.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env,
                start_new_session=True,
                close_fds=True,
            )
        old = self._children.pop(service.name, None)
        if old is not None:
            old.poll()
        self._children[service.name] = proc
        atomicfile.write_bytes(service.pid_file, f"{proc.pid}\n".encode())
        return proc.pid

    def exit_status(self, name: str) -> int | None:
        """The exit status of a child this supervisor started, None while it runs
        (or when it was started by another process).  Negative: killed by that signal."""
        proc = self._children.get(name)
        return None if proc is None else proc.poll()

    def pid(self, service: Service) -> int | None:
        """The PID of `service` if it is running now and is really ours, else None.

        The PID file is the record (a person may start a service by hand and write it);
        when it names a child of this supervisor, the child's handle decides, so an
        exited child is never mistaken for a live process."""
        pid = read_pid(service.pid_file)
        if pid is None:
            return None
        proc = self._children.get(service.name)
        if proc is not None and proc.pid == pid:
            return pid if proc.poll() is None else None
        return pid if is_ours(pid, service) else None

    def signal(self, service: Service, sig: int) -> int | None:
        """Send `sig` to `service` if it runs; return the PID signalled."""
        pid = self.pid(service)
        if pid is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        return pid

    def wait_exit(self, service: Service, pid: int, timeout: float) -> bool:
        """Wait until `pid` has exited; True if it did within `timeout`."""
        deadline = time.monotonic() + timeout
        proc = self._children.get(service.name)
        while True:
            if proc is not None and proc.pid == pid:
                if proc.poll() is not None:
                    return True
            elif has_exited(pid, service):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def stop(self, services: Sequence[Service], grace: float = DEFAULT_GRACE) -> list[str]:
        """SIGTERM every running service at once, SIGKILL what is left after `grace`
        seconds; remove their PID files.  Returns the names of those that were running."""
        running = [(s, pid) for s in services if (pid := self.pid(s)) is not None]
        for _s, pid in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
                if is_stopped(pid):  # a stopped process only sees SIGTERM after SIGCONT
                    os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + grace
        for s, pid in running:
            if not self.wait_exit(s, pid, max(0.0, deadline - time.monotonic())):
                if is_ours(pid, s):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                self.wait_exit(s, pid, 10.0)
        for s in services:
            if self.pid(s) is None:
                s.pid_file.unlink(missing_ok=True)
        return [s.name for s, _ in running]


def tail(path: Path, lines: int = 20) -> str:
    """The last `lines` lines of a log file, or a note that there is none."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read()
    except FileNotFoundError:
        return f"({path} does not exist)"
    text = data.decode(errors="replace").rstrip("\n")
    if not text:
        return f"({path} is empty)"
    return "\n".join(text.splitlines()[-lines:])
