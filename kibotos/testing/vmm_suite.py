"""`check_vmm_backend`: the conformance suite of the VMM backend seam
(`kibotos.backends.VmmBackend`), for the built-in ``qemu`` and ``firecracker``, the test
VMM ``testvmm``, and any third-party backend.

The caller gives a `VmmCase`: the backend's `BackendFactory`, a launch description it
must accept (docs/vm.md, "Launch description"; the files it names exist), and for the
checks that run a guest a supervisor to start its unit with and a readiness timeout::

    case = VmmCase(BackendFactory(AcmeVmm, {...}), launch, supervisor=direct)

    @pytest.mark.parametrize("check", VMM_CHECKS, ids=check_id)
    async def test_conformance(check):
        await check(case)

`VMM_UNIT_CHECKS` need no guest: the class, its options, ``probe``, the unit it builds
for the launch and the launches it refuses.  `VMM_GUEST_CHECKS` start that unit through
the supervisor, as the node does, and check readiness, the guest channel (a session
opened on it by hand, per docs/guest-protocol.md, gets the agent's hello) and that a
stopped unit's guest is gone; each stops what it started.  `check_vmm_backend` runs both.  What
a backend builds beyond the contract (its command line, its jail) stays in its own tests.
"""

from __future__ import annotations

import binascii
import contextlib
import json
import os
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import trio

from kibotos.backends import Supervisor, UnitSpec, VmmBackend
from kibotos.core.errors import InvalidArgument, KibotosError
from kibotos.testing.conformance import BackendFactory, expect_raises

VmmFactory = BackendFactory[VmmBackend]

#: The unit properties of a VMM service every backend asks for (spec, "VMM service").
VMM_SERVICE_PROPERTIES: Mapping[str, Any] = {
    "Type": "exec", "Restart": "no", "KillMode": "control-group", "OOMPolicy": "kill",
    "Slice": "kibotos-vmm.slice"}
#: What a restarted node lists to find its VMM units (kibotos.node.instances.adoption).
VMM_UNIT_PREFIX = "kibotos-vmm-"
#: Where supervisors look up a program given without a path (`UnitSpec`).
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: The guest protocol's frame header (docs/guest-protocol.md, "Framing").
GUEST_MAGIC = b"\x8bKGP"
_FRAME_HEAD = struct.Struct("!4sBBHIII")  # magic kind flags reserved stream length crc
_HEADER_SIZE = _FRAME_HEAD.size + 4
_KIND_CONTROL = 1
#: Zeros a host sends first on each connection, completing any half frame a dead
#: predecessor left (docs/guest-protocol.md, "Resync preamble").
RESYNC_PREAMBLE_SIZE = _HEADER_SIZE + 256 * 1024
#: How long a check waits for a stopped guest's refusal (bounded, not timed).
GONE_TIMEOUT = 5.0


@dataclass(frozen=True)
class VmmCase:
    """The backend under test and what its checks need."""

    factory: VmmFactory
    #: A launch description the backend must accept; the checks copy it, never change it.
    launch: Mapping[str, Any]
    #: Starts and stops the units of the guest checks (None: only the unit checks run).
    supervisor: Supervisor | None = None
    #: `wait_ready`'s timeout: generous, it only bounds a hang (TCG boots are slow).
    ready_timeout: float = 180.0


VmmCheck = Callable[[VmmCase], Awaitable[None]]


async def _probed(case: VmmCase) -> VmmBackend:
    """A new backend object, probed as the node probes it before its first launch."""
    vmm = case.factory()
    await vmm.probe()
    return vmm


def _executable(program: str) -> bool:
    if os.path.isabs(program):
        return os.access(program, os.X_OK)
    return any(os.access(Path(d) / program, os.X_OK) for d in DEFAULT_PATH.split(":"))


# ------------------------------------------------------------------------- unit checks


async def check_the_class_meets_the_contract(case: VmmCase) -> None:
    cls = case.factory.cls
    vmm = case.factory()
    assert isinstance(vmm, VmmBackend), f"{vmm!r} lacks a member of the protocol"
    assert isinstance(cls.name, str), cls.name
    assert cls.name, "the backend's name is empty"
    flags = {k: v for k, v in vars(cls).items() if k.startswith("CAN_")}
    assert all(isinstance(v, bool) for v in flags.values()), f"CAN_* must be bools: {flags}"


async def check_unknown_options_are_refused(case: VmmCase) -> None:
    """A typo in ``[vmm.<name>]`` is an error, not silently ignored."""
    refusal = expect_raises(
        InvalidArgument, lambda: case.factory.with_options(kibotos_check_no_such_option=1),
        "an unknown option")
    assert "kibotos_check_no_such_option" in str(refusal), refusal


async def check_probe_reports_what_works(case: VmmCase) -> None:
    """``probe`` answers facts the node logs and ``kibo node get`` shows: JSON data."""
    facts = await case.factory().probe()
    assert isinstance(facts, Mapping), facts
    json.dumps(facts)


async def check_the_unit_is_a_vmm_service(case: VmmCase) -> None:
    """The unit the node starts: named for adoption, a program that exists, the VMM
    service properties, its output in the Instance directory."""
    unit = (await _probed(case)).unit_for(case.launch)
    assert isinstance(unit, UnitSpec), unit
    assert unit.name.startswith(VMM_UNIT_PREFIX), unit.name
    argv = list(unit.argv)
    assert argv, "the unit has no command"
    assert all(isinstance(a, str) for a in argv), argv
    assert _executable(argv[0]), f"the unit's program {argv[0]} is not executable"
    for key, value in VMM_SERVICE_PROPERTIES.items():
        assert unit.properties.get(key) == value, (key, unit.properties.get(key))
    assert all(isinstance(k, str) and isinstance(v, str)
               for k, v in unit.environment.items()), unit.environment
    runtime = Path(str(case.launch["runtime_dir"]))
    assert unit.working_directory == runtime, unit.working_directory
    assert unit.log_path is not None, "the VMM's output must go to the Instance directory"
    assert runtime in Path(unit.log_path).parents, unit.log_path


async def check_the_unit_is_named_by_the_launch(case: VmmCase) -> None:
    vmm = await _probed(case)
    name = f"{VMM_UNIT_PREFIX}kibotos-check.service"
    assert vmm.unit_for({**case.launch, "unit_name": name}).name == name


async def check_the_same_launch_gives_the_same_unit(case: VmmCase) -> None:
    """A restarted node builds the unit again to compare it with what runs."""
    vmm = await _probed(case)
    assert vmm.unit_for(case.launch) == vmm.unit_for(case.launch)
    assert (await _probed(case)).unit_for(case.launch) == vmm.unit_for(case.launch)


async def check_bad_launches_are_refused(case: VmmCase) -> None:
    """A launch the backend cannot run is `InvalidArgument` naming the key, before
    anything runs."""
    vmm = await _probed(case)
    launch: dict[str, Any] = dict(case.launch)
    without_id = {k: v for k, v in launch.items() if k != "instance_id"}
    for bad, key in [
        ({**launch, "kibotos_check_unknown_key": 1}, "kibotos_check_unknown_key"),
        (without_id, "instance_id"),
        ({**launch, "runtime_dir": "relative/run"}, "runtime_dir"),
        ({**launch, "template_image": "/nonexistent/kibotos-check.img"}, "template_image"),
        ({**launch, "memory": "32M"}, "memory"),
        ({**launch, "memory": True}, "memory"),
    ]:
        refusal = expect_raises(InvalidArgument, partial(vmm.unit_for, bad),
                                f"a launch with a bad {key}")
        assert key in str(refusal), refusal


VMM_UNIT_CHECKS: tuple[VmmCheck, ...] = (
    check_the_class_meets_the_contract,
    check_unknown_options_are_refused,
    check_probe_reports_what_works,
    check_the_unit_is_a_vmm_service,
    check_the_unit_is_named_by_the_launch,
    check_the_same_launch_gives_the_same_unit,
    check_bad_launches_are_refused,
)


# ------------------------------------------------------------------------- guest checks


@contextlib.asynccontextmanager
async def _running(case: VmmCase) -> AsyncIterator[tuple[VmmBackend, UnitSpec]]:
    """The launch's unit started through the case's supervisor; stopped afterwards."""
    if case.supervisor is None:
        raise AssertionError("the guest checks need a supervisor (VmmCase.supervisor)")
    vmm = await _probed(case)
    unit = vmm.unit_for(case.launch)
    await case.supervisor.start(unit)
    try:
        yield vmm, unit
    finally:
        with trio.CancelScope(shield=True):
            await case.supervisor.stop(unit.name, timeout=10)


def _check_hello(hello: Mapping[str, Any]) -> None:
    assert isinstance(hello, Mapping), hello
    assert isinstance(hello.get("protocol_version"), int), hello
    assert hello["protocol_version"] >= 1, hello
    assert isinstance(hello.get("boot_id"), str), hello
    assert hello["boot_id"], hello
    capabilities = hello.get("capabilities")
    assert isinstance(capabilities, list), hello
    assert all(isinstance(c, str) for c in capabilities), hello
    json.dumps(dict(hello))  # the node keeps it in the Instance record


def _control_frame(message: Mapping[str, Any]) -> bytes:
    payload = json.dumps(dict(message), separators=(",", ":")).encode()
    head = _FRAME_HEAD.pack(GUEST_MAGIC, _KIND_CONTROL, 0, 0, 0, len(payload),
                            binascii.crc32(payload))
    return head + struct.pack("!I", binascii.crc32(head)) + payload


async def _hello_over(stream: trio.abc.Stream, deadline: float) -> dict[str, Any]:
    """Open a guest session by hand, as docs/guest-protocol.md says a host does (the
    resync preamble, then ``hello_request``), and return the agent's ``hello``; frames
    before it (another session's, padding) are skipped."""
    await stream.send_all(bytes(RESYNC_PREAMBLE_SIZE) + _control_frame({"type": "hello_request"}))
    data = b""
    with trio.move_on_at(deadline):
        while True:
            data = data.lstrip(b"\0")
            if len(data) >= _HEADER_SIZE:
                magic, kind, _flags, _res, _stream, length, _crc = \
                    _FRAME_HEAD.unpack_from(data)
                assert magic == GUEST_MAGIC, f"not the guest protocol: {data[:16]!r}"
                if len(data) >= _HEADER_SIZE + length:
                    payload, data = data[_HEADER_SIZE:_HEADER_SIZE + length], \
                        data[_HEADER_SIZE + length:]
                    if kind == _KIND_CONTROL:
                        message = json.loads(payload)
                        if message.get("type") == "hello":
                            return dict(message)
                    continue
            chunk = await stream.receive_some()
            assert chunk, "the guest channel ended before the agent's hello"
            data += chunk
    raise AssertionError("no hello from the agent over the guest channel")


async def check_the_guest_becomes_ready(case: VmmCase) -> None:
    """``wait_ready`` returns the agent's hello; called again (a restarted node), the
    same guest's."""
    async with _running(case) as (vmm, _unit):
        hello = await vmm.wait_ready(case.launch, timeout=case.ready_timeout)
        _check_hello(hello)
        again = await vmm.wait_ready(case.launch, timeout=case.ready_timeout)
        assert again["boot_id"] == hello["boot_id"], (hello, again)


async def check_the_guest_channel_reaches_the_agent(case: VmmCase) -> None:
    """``guest_channel`` is a byte stream to the agent, which answers a new session
    with its hello; each call is a new connection."""
    async with _running(case) as (vmm, _unit):
        hello = await vmm.wait_ready(case.launch, timeout=case.ready_timeout)
        for _ in range(2):
            stream = await vmm.guest_channel(case.launch, timeout=case.ready_timeout)
            assert isinstance(stream, trio.abc.Stream), stream
            try:
                frame = await _hello_over(stream, trio.current_time() + case.ready_timeout)
            finally:
                await trio.aclose_forcefully(stream)
            assert frame.get("boot_id") == hello["boot_id"], (frame, hello)


async def check_a_stopped_guest_is_gone(case: VmmCase) -> None:
    """Once the supervisor stopped the unit, readiness and the channel fail with an
    error, within their timeouts, rather than hang or answer."""
    async with _running(case) as (vmm, unit):
        await vmm.wait_ready(case.launch, timeout=case.ready_timeout)
        assert case.supervisor is not None
        await case.supervisor.stop(unit.name, timeout=10)
        with trio.fail_after(GONE_TIMEOUT + case.ready_timeout):
            try:
                await vmm.wait_ready(case.launch, timeout=GONE_TIMEOUT)
            except KibotosError:
                pass
            else:
                raise AssertionError("wait_ready answered for a stopped unit")
            try:
                stream = await vmm.guest_channel(case.launch, timeout=GONE_TIMEOUT)
            except (KibotosError, OSError):
                pass
            else:
                await trio.aclose_forcefully(stream)
                raise AssertionError("guest_channel connected to a stopped unit")


VMM_GUEST_CHECKS: tuple[VmmCheck, ...] = (
    check_the_guest_becomes_ready,
    check_the_guest_channel_reaches_the_agent,
    check_a_stopped_guest_is_gone,
)

VMM_CHECKS: tuple[VmmCheck, ...] = VMM_UNIT_CHECKS + VMM_GUEST_CHECKS


async def check_vmm_backend(case: VmmCase) -> None:
    """Every check of `VMM_CHECKS`, in order; the first failure raises, naming it."""
    for check in VMM_CHECKS:
        try:
            await check(case)
        except (AssertionError, KibotosError) as exc:
            raise AssertionError(f"{check.__name__}: {exc}") from exc
