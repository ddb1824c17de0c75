"""``stuckvmm``: the ``testvmm`` backend whose VMM has a process that SIGKILL cannot end
at once (tests only; loaded with ``KIBOTOS_TEST_PLUGIN_MODULES=kibotos_stuckvmm``).

Its unit runs `stuckvmm_wrapper.py`, which leaves a child in the unit's process group
waiting in the kernel on ``stuck_path`` (a name on `tests/node/stuck_fuse.py`'s file
system), then execs testvmm's guest.  Stopping the unit ends the guest, but the child
stays until the file system answers: what the node sees when a VMM is stuck in an
uninterruptible wait on storage (spec: "instance cleanup pending").

Options (``[vmm.stuckvmm]``): ``stuck_path`` (required) and testvmm's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from kibotos_testvmm import OPTIONS, TestVmm

from kibotos.sdk import Register, UnitSpec, backend_options, hookimpl

WRAPPER = Path(__file__).with_name("stuckvmm_wrapper.py")


class StuckVmm(TestVmm):
    """See the module docstring."""

    __test__ = False
    name: ClassVar[str] = "stuckvmm"

    def __init__(self, options: Mapping[str, Any]) -> None:
        opts = backend_options("vmm", self.name, options, {"stuck_path", *OPTIONS})
        self.stuck_path = str(opts.required_path("stuck_path"))
        super().__init__({k: v for k, v in options.items() if k != "stuck_path"})

    def unit_for(self, launch: Mapping[str, Any]) -> UnitSpec:
        spec = super().unit_for(launch)
        argv = [self.python, "-I", str(WRAPPER), "--stuck", self.stuck_path, "--",
                *spec.argv]
        return dataclasses.replace(spec, argv=argv)


@hookimpl
def kibotos_register_vmm(register: Register) -> None:
    register(StuckVmm)
