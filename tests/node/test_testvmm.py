"""The test-only ``testvmm`` backend itself: the shared conformance suite of the VMM
seam (`kibotos.testing.vmm_suite`, its unit, readiness and guest channel through the
``direct`` supervisor exactly as the node runs it), then its own knobs and a command
run in its "guest"."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
from instance_harness import registries, short_dir

from kibotos.backends import VmmBackend
from kibotos.core.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from kibotos.guest import open_guest_channel
from kibotos.testing.conformance import BackendFactory, check_id
from kibotos.testing.vmm_suite import VMM_CHECKS, VmmCase, VmmCheck


@pytest.fixture
async def run_dir() -> AsyncIterator[Path]:
    d = short_dir("kt-")
    (d / "platform").mkdir()
    for name in ("vmlinux", "initramfs", "image", "rw.img"):
        (d / ("platform" if name in ("vmlinux", "initramfs") else ".") / name).write_bytes(b"x")
    yield d
    sup = registries().supervisor.get("direct")({"state_dir": str(d / "units")})
    for info in await sup.list(""):
        await sup.stop(info.name, timeout=1)
    shutil.rmtree(d, ignore_errors=True)


def backend(**options) -> VmmBackend:
    return registries().vmm.get("testvmm")(options)


def launch_for(d: Path) -> dict:
    return {"instance_id": "inst-t", "runtime_dir": str(d), "platform_dir": str(d / "platform"),
            "template_image": str(d / "image"), "writable_layer": str(d / "rw.img"),
            "memory": 128 << 20}


@pytest.mark.parametrize("check", VMM_CHECKS, ids=check_id)
async def test_conformance(check: VmmCheck, run_dir: Path) -> None:
    sup = registries().supervisor.get("direct")({"state_dir": str(run_dir / "units")})
    await check(VmmCase(BackendFactory(registries().vmm.get("testvmm"), {}),
                        launch_for(run_dir), supervisor=sup, ready_timeout=60))


async def test_unit_shape(run_dir: Path) -> None:
    unit = backend().unit_for(launch_for(run_dir))
    assert unit.name == "kibotos-vmm-inst-t.service"
    assert unit.argv[-4:] == ["--socket", str(run_dir / "agent.sock"),
                              "--root", str(run_dir / "guestroot")]
    assert unit.log_path == run_dir / "vmm.log"
    assert unit.working_directory == run_dir
    assert unit.properties["KillMode"] == "control-group"
    assert "--hang" in backend(hang=True).unit_for(launch_for(run_dir)).argv
    with pytest.raises(InvalidArgument, match=r"^\[vmm\.testvmm\]: unknown option colour "):
        backend(colour="red")
    with pytest.raises(InvalidArgument, match="template_image"):
        backend().unit_for({**launch_for(run_dir), "template_image": str(run_dir / "nope")})


async def test_exec_through_a_real_unit(run_dir: Path) -> None:
    vmm = backend()
    assert (await vmm.probe())["backend"] == "testvmm"
    sup = registries().supervisor.get("direct")({"state_dir": str(run_dir / "units")})
    launch = launch_for(run_dir)
    info = await sup.start(vmm.unit_for(launch))
    hello = await vmm.wait_ready(launch, timeout=60)
    assert "exec" in hello["capabilities"]
    stream = await vmm.guest_channel(launch, timeout=10)
    async with open_guest_channel(stream) as guest:
        await guest.wait_hello(trio.current_time() + 30)
        status, out, _ = await guest.run(["sh", "-c", "echo inside"])
    assert (status.exit_code, out) == (0, b"inside\n")
    assert (run_dir / "guestroot" / "etc").is_dir()
    await sup.stop(info.name, timeout=5)
    assert await sup.describe(info.name) is None


async def test_hang_and_probe_error(run_dir: Path) -> None:
    vmm = backend(hang=True)
    sup = registries().supervisor.get("direct")({"state_dir": str(run_dir / "units")})
    launch = launch_for(run_dir)
    await sup.start(vmm.unit_for(launch))
    with pytest.raises(DeadlineExceeded):
        await vmm.wait_ready(launch, timeout=1)
    with pytest.raises(FailedPrecondition, match="no hypervisor"):
        await backend(probe_error="no hypervisor").probe()
