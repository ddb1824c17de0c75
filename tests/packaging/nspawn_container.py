"""A booted Debian 12 systemd in a systemd-nspawn container, for the package tests.

TESTBED, "Real systemd in tests": PID 1 of the test machines is not systemd, but
``systemd-nspawn -b --keep-unit --register=no -D <rootfs>`` boots one in about a
second; commands run inside with ``nsenter -t <its PID 1> -a``.

* The root file system is debootstrapped once (``--variant=minbase`` with systemd,
  dbus and the packages' dependencies, so that ``apt install ./*.deb`` needs no
  download) and cached by its inputs like the VM tests' images
  (`kibotos.platform.cache.cached_build`, under ``$KIBOTOS_TEST_CACHE`` or
  /var/cache/kibotos-test).  The first run costs the debootstrap (a few minutes, most
  of it qemu's dependencies); later runs take seconds.
* Each container runs on an overlay of that cache (the cache is the read-only lower
  layer, a temporary directory takes every write), so tests never change the cache
  and start from the same clean system.
* ``--private-network``: the container has only its own loopback; ctrl and the node
  it runs cannot meet anything on the host's.
* Everything is bounded: the boot waits at most `BOOT_TIMEOUT`, every command has a
  timeout, and `close` powers the container off, kills nspawn after a deadline and
  unmounts the overlay.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from kibotos.platform.aptsources import debian_mirror
from kibotos.platform.cache import cached_build, input_key

SUITE = "bookworm"
#: systemd and its bus, and the Depends of the kibotos packages (debian/control), so
#: that installing them needs no network.
PACKAGES = ("systemd", "systemd-sysv", "dbus", "python3.11", "passwd", "qemu-system-x86",
            "e2fsprogs", "procps")
BOOT_TIMEOUT = 120
COMMAND_TIMEOUT = 600
PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
TOOLS = ("systemd-nspawn", "debootstrap", "nsenter")


def missing_tools() -> list[str]:
    path = os.environ.get("PATH", "") + ":" + PATH
    return [t for t in TOOLS if shutil.which(t, path=path) is None]


def rootfs(cache: Path) -> Path:
    """The cached, debootstrapped root file system (built on the first call)."""
    mirror = debian_mirror(SUITE)
    inputs = {"suite": SUITE, "variant": "minbase", "packages": list(PACKAGES),
              "mirror": mirror, "kind": "nspawn-rootfs"}

    def build(tmp: Path) -> None:
        target = tmp / "rootfs"
        subprocess.run(["debootstrap", "--variant=minbase",
                        "--include=" + ",".join(PACKAGES), SUITE, str(target), mirror],
                       check=True, capture_output=True, timeout=1800,
                       env={"PATH": PATH, "LANG": "C.UTF-8"})
        # No apt lists (apt install ./x.deb needs none when the dependencies are there),
        # and no machine-id: systemd makes a fresh one at each boot.
        for lists in (target / "var/lib/apt/lists").glob("*_*"):
            lists.unlink()
        (target / "etc/machine-id").write_text("")
        (tmp / "manifest.json").write_text("{}\n")

    entry = cached_build(cache / "nspawn", input_key(inputs), "manifest.json", build)
    return entry / "rootfs"


class Container:
    """A booted container on an overlay of `lower`; `binds` are read-only bind mounts
    (host path, container path)."""

    def __init__(self, lower: Path, work: Path, binds: Sequence[tuple[Path, str]] = ()
                 ) -> None:
        self.work = work
        self.merged = work / "merged"
        for d in ("upper", "overlay-work", "merged"):
            (work / d).mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={lower},upperdir={work / 'upper'},"
                        f"workdir={work / 'overlay-work'}", str(self.merged)],
                       check=True, timeout=60)
        argv = ["systemd-nspawn", "-b", "--keep-unit", "--register=no", "--private-network",
                "--console=passive", "-q", "-M", f"kibotos-test-{os.getpid()}",
                "-D", str(self.merged)]
        argv += [f"--bind-ro={host}:{inside}" for host, inside in binds]
        self.log = open(work / "nspawn.log", "wb")  # noqa: SIM115 (closed by close())
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT, env={"PATH": PATH})
        try:
            self.leader = self._wait_for_leader()
            self._wait_running()
        except BaseException:
            self.close()
            raise

    def _wait_for_leader(self) -> int:
        """The container's PID 1: nspawn's child that runs systemd."""
        deadline = time.monotonic() + BOOT_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"systemd-nspawn exited: {self._log_tail()}")
            for child in _descendants(self.proc.pid):
                try:
                    exe = os.readlink(f"/proc/{child}/exe")
                except OSError:
                    continue
                if exe.endswith("/systemd"):
                    return child
            time.sleep(0.1)
        raise TimeoutError(f"no systemd in the container: {self._log_tail()}")

    def _wait_running(self) -> None:
        """Until systemd says the boot is done (its socket appears a moment after the
        process: until then systemctl cannot connect)."""
        deadline = time.monotonic() + BOOT_TIMEOUT
        while True:
            left = max(1, int(deadline - time.monotonic()))
            proc = self.run(["timeout", str(left), "systemctl", "is-system-running",
                             "--wait"], check=False)
            if proc.stdout.strip() in ("running", "degraded"):
                return
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"container did not boot: {proc.stdout} {proc.stderr} "
                                   f"{self._log_tail()}")
            time.sleep(0.2)

    def run(self, argv: Sequence[str] | str, *, check: bool = True,
            timeout: float = COMMAND_TIMEOUT) -> subprocess.CompletedProcess[str]:
        """`argv` (a list, or a string for ``sh -ec``) inside the container, as root,
        with a plain environment; `check` raises with the output on a nonzero exit."""
        cmd = ["sh", "-ec", argv] if isinstance(argv, str) else list(argv)
        proc = subprocess.run(["nsenter", "-t", str(self.leader), "-a", "--", *cmd],
                              capture_output=True, text=True, timeout=timeout,
                              env={"PATH": PATH, "LANG": "C.UTF-8",
                                   "DEBIAN_FRONTEND": "noninteractive", "HOME": "/root"})
        if check and proc.returncode != 0:
            raise AssertionError(f"{cmd} exited {proc.returncode}:\n{proc.stdout[-4000:]}"
                                 f"\n{proc.stderr[-4000:]}")
        return proc

    def host_in_netns(self, argv: Sequence[str], env: dict[str, str], *,
                      timeout: float = COMMAND_TIMEOUT) -> subprocess.CompletedProcess[str]:
        """A host program in the container's network namespace only (its files and
        caches are the host's, its loopback the container's): how the test reaches the
        container's ctrl, which has no other network."""
        proc = subprocess.run(["nsenter", "-t", str(self.leader), "-n", "--", *argv],
                              capture_output=True, text=True, timeout=timeout,
                              env={"PATH": PATH, "LANG": "C.UTF-8", **env})
        if proc.returncode != 0:
            raise AssertionError(f"{argv} exited {proc.returncode}:\n{proc.stdout[-4000:]}"
                                 f"\n{proc.stderr[-4000:]}")
        return proc

    def _log_tail(self) -> str:
        self.log.flush()
        return (self.work / "nspawn.log").read_text(errors="replace")[-2000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            # SIGRTMIN+4 asks systemd as PID 1 to power off; nspawn exits with it.
            leader = getattr(self, "leader", None)
            if leader is not None:
                subprocess.run(["kill", "-s", "SIGRTMIN+4", str(leader)], check=False)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.log.close()
        subprocess.run(["umount", "-l", str(self.merged)], check=False, timeout=60)


def _descendants(pid: int) -> list[int]:
    """`pid`'s children, grandchildren … (nspawn runs the container's init below an
    intermediate process), nearest first."""
    out: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop(0)
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                found = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            out += found
            todo += found
    return out
