"""What the Firecracker tests share: a jail-ready tree, the fake jailer and stand-in
behind backend options, units run as plain processes, and the real guest agent.

Socket paths must fit 107 bytes, and pytest's ``tmp_path`` is long, so every tree is
made in a short directory under /tmp (`short_dir`), unmounted and removed afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kibotos_firecracker import jail as jailmod
from kibotos_firecracker.backend import FirecrackerVmm

from kibotos.backends import UnitSpec
from kibotos.guest import AGENT_PATH

HERE = Path(__file__).resolve().parent
FAKE_JAILER = HERE / "fake_jailer.py"
STANDIN = HERE / "fc_standin.py"
GUEST_PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
TIMEOUT = 60.0  # generous: machines are noisy
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
#: The VMM account of the tests: any unprivileged IDs do (the jailer needs no account).
VMM_UID = 64123
VMM_GID = 64124
AGENT_PORT = 1024


@contextlib.contextmanager
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="fc-", dir="/tmp"))
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            for point in jailmod.mounts_under(path):
                subprocess.run(["umount", "-l", str(point)], check=False,
                               capture_output=True)
        shutil.rmtree(path, ignore_errors=True)


def write_executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@dataclass
class FcEnv:
    """One test's tree: sandbox root, fake binaries, Platform, images, runtime dir."""

    root: Path
    guest_ports: dict[int, Path] = field(default_factory=dict)
    console_text: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        r = self.root
        self.base = r / "sandbox"
        self.base.mkdir(mode=0o700)
        bindir = r / "bin"
        bindir.mkdir()
        self.firecracker = write_executable(
            bindir / "firecracker", "#!/bin/sh\necho 'Firecracker v1.17.0-dev (stand-in)'\n")
        self.config = r / "fake-jailer.json"
        self.jailer_record = r / "jailer-record.json"
        self.api_record = r / "api-calls.jsonl"
        self.jailer = write_executable(
            bindir / "jailer", f"#!/bin/sh\nexec {sys.executable} {FAKE_JAILER} "
            f"--fake-config {self.config} \"$@\"\n")
        self.write_config()
        plat = r / "platform"
        plat.mkdir()
        for name in ("vmlinux", "initramfs"):
            (plat / name).write_bytes(name.encode() * 64)
            (plat / name).chmod(0o644)
        self.template = r / "template.img"
        self.template.write_bytes(b"t" * 4096)
        self.template.chmod(0o644)
        self.rw = r / "rw.img"
        self.rw.write_bytes(b"")
        self.rw.chmod(0o600)
        self.vol = r / "vol0.img"
        self.vol.write_bytes(b"")
        self.vol.chmod(0o600)
        self.run = r / "run"
        self.run.mkdir()
        self.launch: dict[str, Any] = {
            "instance_id": "ins-1",
            "runtime_dir": str(self.run),
            "platform_dir": str(plat),
            "template_image": str(self.template),
            "writable_layer": str(self.rw),
            "volumes": [{"path": str(self.vol)}],
            "vcpus": 2,
            "memory": "512M",
        }

    def write_config(self) -> None:
        args: list[str] = ["--record", str(self.api_record)]
        for port, path in self.guest_ports.items():
            args += ["--guest-port", f"{port}={path}"]
        for line in self.console_text:
            args += ["--console-text", line]
        self.config.write_text(json.dumps({"record": str(self.jailer_record),
                                           "standin_args": args}))

    @property
    def options(self) -> dict[str, Any]:
        return {"jailer_binary": str(self.jailer), "firecracker_binary": str(self.firecracker),
                "uid": VMM_UID, "gid": VMM_GID, "chroot_base_dir": str(self.base),
                "vsock_port": AGENT_PORT}

    def backend(self, **over: Any) -> FirecrackerVmm:
        return FirecrackerVmm({**self.options, **over})

    def api_calls(self) -> list[dict[str, Any]]:
        if not self.api_record.exists():
            return []
        return [json.loads(line) for line in self.api_record.read_text().splitlines()]

    def jailer_facts(self) -> dict[str, Any]:
        return dict(json.loads(self.jailer_record.read_text()))


class Unit:
    """A UnitSpec run as a plain process in its own session (what a supervisor does,
    minus the bookkeeping): the argv, its working directory, only its environment,
    output appended to its log."""

    def __init__(self, spec: UnitSpec) -> None:
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               **spec.environment}
        assert spec.log_path is not None
        with open(spec.log_path, "ab") as log:
            self.proc = subprocess.Popen(list(spec.argv), cwd=spec.working_directory,
                                         env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=log, start_new_session=True)

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


@contextlib.contextmanager
def running(spec: UnitSpec) -> Iterator[Unit]:
    unit = Unit(spec)
    try:
        yield unit
    finally:
        unit.stop()


def start_agent(socket_path: Path, root: Path) -> subprocess.Popen[bytes]:
    """The real guest agent, listening on a unix socket (the guest end of the vsock)."""
    root.mkdir(exist_ok=True)
    log = open(socket_path.with_suffix(".log"), "ab")  # noqa: SIM115 - the child keeps it
    try:
        return subprocess.Popen(
            [GUEST_PYTHON, str(AGENT_PATH), "--socket", str(socket_path), "--root", str(root)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
    finally:
        log.close()


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
