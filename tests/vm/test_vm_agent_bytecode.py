"""The agent in a real guest runs from the bytecode the Template build compiled.

If the ``.pyc`` files did not match the guest's Python (another version, a stale
source), the guest would compile the package at every boot and write new bytecode into
the writable layer; neither may happen.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import trio
from kibotos_qemu.backend import QemuVmm
from vm_harness import POWEROFF, ROOT_TCG, launch_for, running_unit, wait_exit

from kibotos.guest import open_guest_channel
from kibotos.platform import build_template as bt
from kibotos.platform.images import create_writable_layer, read_file

pytestmark = [pytest.mark.slow, pytest.mark.qemu]

BOOT_TIMEOUT = 180
IMPORT_CLI = ("import sys; sys.path.insert(0, '/usr/lib/kibotos-guest'); "
              "import kibotos_guest.cli")


async def test_the_guest_imports_the_precompiled_agent(platform_dir: Path,
                                                       template_dir: Path, run_dir: Path):
    create_writable_layer(run_dir / "rw.img", 1 << 30)
    launch = launch_for(run_dir, platform_dir, template_dir)
    vmm = QemuVmm(ROOT_TCG)
    async with running_unit(vmm.unit_for(launch)) as proc:
        await vmm.wait_ready(launch, timeout=BOOT_TIMEOUT)
        async with open_guest_channel(await vmm.guest_channel(launch)) as guest:
            await guest.wait_hello(trio.current_time() + 30)
            status, _, err = await guest.run(["python3", "-v", "-c", IMPORT_CLI])
            assert status.returncode == 0, err
            text = err.decode(errors="replace")
            package = f"{bt.AGENT_GUEST_DIR}/{bt.AGENT_PACKAGE}"
            for module in ("__init__", "cli", "core", "runtime/channel", "runtime/framing",
                           "runtime/loop"):
                folder, _, name = module.rpartition("/")
                where = f"{package}/{folder}" if folder else package
                pattern = (rf"code object from '{re.escape(where)}/__pycache__/"
                           rf"{name}\.cpython-3\d+\.pyc'")
                assert re.search(pattern, text), f"{module} was not loaded from bytecode"
            assert f"# wrote '{package}" not in text
            await guest.exec(POWEROFF)
            assert await wait_exit(proc, BOOT_TIMEOUT) == 0
    # The running agent wrote no bytecode of its own into the writable layer.
    with pytest.raises(FileNotFoundError):
        read_file(run_dir / "rw.img", f"/upper{bt.AGENT_GUEST_DIR}")
