"""``testvmm``: a test-only VMM backend whose "VM" is the real guest agent on the host.

Loaded through ``KIBOTOS_TEST_PLUGIN_MODULES=kibotos_testvmm`` with ``tests/testplugins``
on ``PYTHONPATH`` (docs/plugins.md, "Test-only plugins"); never installed.  Its unit runs
`testvmm_guest.py`, which makes ``<runtime_dir>/guestroot`` and execs
`kibotos/guest/agent.py --socket <runtime_dir>/agent.sock --root <guestroot>`: the node's
whole path (launch record, supervisor, readiness, configure, exec, stop_prepare, sync,
unit stop) runs for real, without QEMU.

It reads the same launch description as ``qemu`` (checked with the qemu backend's own
parser, so the node cannot build a launch that only this backend accepts).  The guest
is not a kibotos Platform: nothing is mounted at ``/run/kibotos/rw``, so it declares no
retained file systems (`GUEST_RETAINED_FILESYSTEMS`), and stop_prepare ends the guest's
processes and syncs/freezes nothing on the host.

Options (``[vmm.testvmm]``): ``python`` (interpreter of the unit; default this one),
``hang`` (the agent never starts: readiness times out), ``refuse`` (the agent announces
protocol version 0), ``probe_error`` (probe raises this message: the backend is unusable),
A launch with a ``network`` runs the unit in the Instance's namespace and gives the
"VM" a NIC on the node's tap in a namespace of its own (`testvmm_guest.py`, ``--tap``).
``write_records`` (the "VM" keeps appending sequence-numbered records to each writable
Volume's block file and to the writable layer's until it is killed: the fencing tests'
stand-in for a guest's I/O).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import trio
from kibotos_qemu.launch import parse_launch

from kibotos.sdk import (
    FailedPrecondition,
    Register,
    UnitSpec,
    VmmBackend,
    backend_options,
    hookimpl,
)
from kibotos.sdk.guest import (
    AGENT_PATH,
    connect_unix_with_retry,
    first_kibotos_error,
    open_guest_channel,
)

GUEST_SCRIPT = Path(__file__).with_name("testvmm_guest.py")
OPTIONS = frozenset({"python", "hang", "refuse", "probe_error", "write_records"})


class TestVmm(VmmBackend):
    """See the module docstring."""

    __test__ = False  # not a pytest test class, whatever its name says
    name: ClassVar[str] = "testvmm"
    GUEST_RETAINED_FILESYSTEMS: ClassVar[tuple[str, ...]] = ()
    CAN_KVM: ClassVar[bool] = False
    CAN_NETWORK: ClassVar[bool] = True

    def __init__(self, options: Mapping[str, Any]) -> None:
        opts = backend_options("vmm", self.name, options, OPTIONS)
        self.python = opts.text("python", sys.executable)
        self.hang = opts.flag("hang", False)
        self.refuse = opts.flag("refuse", False)
        self.probe_error = opts.text_or_none("probe_error")
        self.write_records = opts.flag("write_records", False)

    async def probe(self) -> Mapping[str, Any]:
        if self.probe_error:
            raise FailedPrecondition(f"testvmm backend: {self.probe_error}")
        return {"backend": self.name, "accelerator": "none"}

    def unit_for(self, launch: Mapping[str, Any]) -> UnitSpec:
        spec = parse_launch(launch)
        argv = [self.python, "-I", str(GUEST_SCRIPT), "--agent", str(AGENT_PATH),
                "--socket", str(spec.agent_socket), "--root",
                str(spec.runtime_dir / "guestroot")]
        if self.hang:
            argv.append("--hang")
        if self.refuse:
            argv.append("--refuse")
        if self.write_records:
            for vol in spec.volumes:
                if not vol.read_only:
                    argv += ["--write", str(vol.path)]
            argv += ["--write", str(spec.writable_layer), "--tag", spec.instance_id]
        properties: dict[str, Any] = {
            "Type": "exec", "Restart": "no", "KillMode": "control-group", "OOMPolicy": "kill",
            "Slice": "kibotos-vmm.slice",
            "Description": f"kibotos test VMM for {spec.instance_id}"}
        if spec.network is not None:  # as qemu: the unit in the namespace, tap by name
            argv += ["--tap", spec.network.tap, "--mac", spec.network.mac]
            properties["NetworkNamespacePath"] = str(spec.network.netns_path)
        return UnitSpec(
            name=spec.unit_name,
            argv=argv,
            properties=properties,
            environment={},
            working_directory=spec.runtime_dir,
            log_path=spec.vmm_log,
        )

    async def guest_channel(self, launch: Mapping[str, Any], *, timeout: float = 10.0
                            ) -> trio.SocketStream:
        spec = parse_launch(launch)
        return await connect_unix_with_retry(spec.agent_socket, trio.current_time() + timeout)

    async def wait_ready(self, launch: Mapping[str, Any], *, timeout: float
                         ) -> Mapping[str, Any]:
        """The agent's hello within `timeout` seconds (DeadlineExceeded otherwise)."""
        deadline = trio.current_time() + timeout
        stream = await self.guest_channel(launch, timeout=timeout)
        try:
            async with open_guest_channel(stream) as guest:
                info = await guest.wait_hello(deadline)
        except BaseExceptionGroup as group:
            found = first_kibotos_error(group)
            if found is None:
                raise
            raise found from None
        return info.to_json()


@hookimpl
def kibotos_register_vmm(register: Register) -> None:
    register(TestVmm)
