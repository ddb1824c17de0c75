"""Run the unit a `QemuVmm` builds, as a plain child process, and always end it.

The tests start exactly the argv, working directory and log file of the `UnitSpec`,
the way a supervisor would, without depending on one.  The process is killed when the
context exits, whatever happened, so a failed test leaves no QEMU behind.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from kibotos.backends import UnitSpec

#: The qemu backend's options for the VMs these tests boot: TCG (TESTBED: KVM guests hang
#: here), and as root, explicitly: the tests' files are in pytest's 0700 temporary
#: directories, which the VMM account kibotos-vmm cannot traverse (the non-root default
#: is covered by test_vm_qemu_backend and the package test).
ROOT_TCG = {"accelerator": "tcg", "user": "root"}


def _open_append(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


@asynccontextmanager
async def running_unit(unit: UnitSpec) -> AsyncIterator[trio.Process]:
    assert unit.log_path is not None
    log = _open_append(unit.log_path)
    try:
        proc = await trio.lowlevel.open_process(
            list(unit.argv), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            cwd=unit.working_directory, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                                             **unit.environment})
    finally:
        os.close(log)
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        with trio.CancelScope(shield=True):
            await proc.wait()


async def wait_exit(proc: trio.Process, timeout: float) -> int:
    with trio.fail_after(timeout):
        return await proc.wait()


def launch_for(run: Path, platform_dir: Path, template_dir: Path, **extra: Any
               ) -> dict[str, Any]:
    return {
        "instance_id": run.name,
        "runtime_dir": str(run),
        "platform_dir": str(platform_dir),
        "template_image": str(template_dir / "image"),
        "writable_layer": str(run / "rw.img"),
        "memory": "256M",
        **extra,
    }


#: Power the guest off from inside: sync, then reboot(LINUX_REBOOT_CMD_POWER_OFF).
#: Debian minbase has no poweroff program (no init system), and a guest-initiated power
#: off is what makes QEMU exit on its own.
POWEROFF = ["python3", "-c",
            "import ctypes,os; os.sync(); ctypes.CDLL(None).reboot(0x4321FEDC)"]
