"""A real systemd for tests: ``systemd --user`` in a private mount namespace.

PID 1 here is not systemd, so ``systemctl`` on the host refuses to work.  TESTBED.md's
lighter recipe boots a user manager instead: in ``unshare --mount --propagation
private`` an empty directory is bind-mounted over ``/run/systemd`` with
``/run/systemd/system`` in it (so the manager believes it was booted by systemd), and
``XDG_RUNTIME_DIR`` points at a fresh directory where it puts its sockets.  It is up in
a fraction of a second, and its units are host processes (host PIDs, host /proc).

One thing the recipe must add: the manager treats the cgroup it starts in as the root of
its tree, and when that is the host's root cgroup it moves *every* host process into its
``init.scope``.  So the manager is started in a cgroup of its own,
``kibotos-test-<random>``, created in every mounted hierarchy; its units live below it,
and `UserSystemd.close` removes the whole subtree again.

The D-Bus bus it registers on is the user session bus at ``$XDG_RUNTIME_DIR/bus``
(dbus-user-session's socket-activated dbus-daemon): the same broker-mediated protocol
the node uses on the system bus in production.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from jeepney import DBusAddress, new_method_call
from jeepney.io.blocking import open_dbus_connection

from kibotos.testing.waiting import wait_until_sync

SYSTEMD = Path("/lib/systemd/systemd")
BOOT_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0

_SCRIPT = r"""
set -eu
for dir in "$@"; do echo $$ > "$dir/cgroup.procs"; done
mount --bind "$KIBOTOS_TEST_EMPTY" /run/systemd
mkdir -p /run/systemd/system
exec "$KIBOTOS_TEST_SYSTEMD" --user --log-target=console --log-level=notice
"""


def cgroup_mounts(*, tracking_only: bool = False) -> list[Path]:
    """Mount points of the cgroup hierarchies in this namespace: every one, or only
    those systemd tracks its units in (cgroup v2, and v1's ``name=systemd``).  The v1
    controller hierarchies get the manager's subtree from systemd itself (and cpuset
    would refuse a process in a fresh cgroup: it has no CPUs yet)."""
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields = right.split()
        if fields[0] == "cgroup2" or (
                fields[0] == "cgroup" and (not tracking_only
                                           or "name=systemd" in fields[2].split(","))):
            mounts.append(Path(left.split()[4]))
    return mounts


def why_unusable() -> str | None:
    """Why a user systemd cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (mount namespace, cgroups)"
    for tool in ("unshare", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    if not SYSTEMD.exists():
        return f"{SYSTEMD} not found (apt-get install systemd)"
    if not Path("/usr/lib/systemd/user/dbus.socket").exists():
        return "no user D-Bus (apt-get install dbus-user-session)"
    if not cgroup_mounts():
        return "no cgroup file system mounted"
    return None


class UserSystemd:
    """One running user manager; `bus` is the D-Bus address its API is reached at."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kibotos-usersd-"))
        self.runtime_dir = self.dir / "xdg"
        self.runtime_dir.mkdir(mode=0o700)
        empty = self.dir / "empty"
        empty.mkdir()
        self.cgroup_name = f"kibotos-test-{secrets.token_hex(4)}"
        self.cgroup_dirs = [m / self.cgroup_name for m in cgroup_mounts()]
        tracking = [m / self.cgroup_name for m in cgroup_mounts(tracking_only=True)]
        for d in tracking:
            d.mkdir()
        self.bus = f"unix:path={self.runtime_dir / 'bus'}"
        self.log_path = self.dir / "systemd.log"
        env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": str(self.dir),
            "XDG_RUNTIME_DIR": str(self.runtime_dir),
            "KIBOTOS_TEST_EMPTY": str(empty),
            "KIBOTOS_TEST_SYSTEMD": str(SYSTEMD),
        }
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "--",
                 "sh", "-c", _SCRIPT, "sh", *map(str, tracking)],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            self._wait_running()
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        """The manager's PID (unshare execs the shell, which execs systemd)."""
        return self.proc.pid

    @property
    def cgroup(self) -> str:
        """The manager's root cgroup path, as /proc/<pid>/cgroup shows it."""
        return f"/{self.cgroup_name}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_running(self) -> None:
        def state() -> str | None:
            """What the manager says (running or degraded once up); a manager that
            exited is an error at once."""
            if self.proc.poll() is not None:
                raise RuntimeError(f"user systemd exited with {self.proc.returncode}:\n"
                                   f"{self.log()}")
            try:
                value = self.system_state()
            except Exception:  # not on the bus yet
                return None
            return value if value in ("running", "degraded") else None

        try:
            wait_until_sync(state, "user systemd to come up", timeout=BOOT_TIMEOUT,
                            interval=0.05)
        except AssertionError as exc:
            raise RuntimeError(f"{exc}\n{self.log()}") from None

    def system_state(self) -> str:
        addr = DBusAddress("/org/freedesktop/systemd1", bus_name="org.freedesktop.systemd1",
                           interface="org.freedesktop.DBus.Properties")
        with open_dbus_connection(self.bus) as conn:
            reply = conn.send_and_get_reply(
                new_method_call(addr, "Get", "ss",
                                ("org.freedesktop.systemd1.Manager", "SystemState")),
                timeout=5)
        if reply.header.message_type.name == "error":
            raise RuntimeError(f"D-Bus error {reply.body}")
        return str(reply.body[0][1])

    def close(self) -> None:
        """Stop the manager (it stops its units), then remove its cgroups and files."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._kill_leftovers()
        for d in self.cgroup_dirs:
            _remove_cgroup_tree(d)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _kill_leftovers(self) -> None:
        """SIGKILL whatever is still in the manager's cgroup tree (a stuck unit)."""
        deadline = time.monotonic() + STOP_TIMEOUT
        while time.monotonic() < deadline:
            pids = {pid for d in self.cgroup_dirs for pid in _pids_below(d)}
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)


def _pids_below(root: Path) -> set[int]:
    pids: set[int] = set()
    if not root.exists():
        return pids
    for dirpath, _dirs, files in os.walk(root):
        if "cgroup.procs" in files:
            with contextlib.suppress(OSError):
                text = Path(dirpath, "cgroup.procs").read_text()
                pids.update(int(p) for p in text.split())
    return pids


def _remove_cgroup_tree(root: Path) -> None:
    """rmdir bottom-up (cgroup directories can only be removed empty, with rmdir)."""
    if not root.exists():
        return
    for dirpath, _dirs, _files in os.walk(root, topdown=False):
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)
