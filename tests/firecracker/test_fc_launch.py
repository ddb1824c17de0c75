"""The ``firecracker`` backend against the stand-in: the unit runs the fake jailer, which
checks its command line and execs the stand-in Firecracker in the jail; every API call
is validated against Firecracker's document; the guest is the real agent on the host,
behind the stand-in's vsock forwarding."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from fc_harness import (
    AGENT_PORT,
    TIMEOUT,
    VMM_GID,
    VMM_UID,
    FcEnv,
    running,
    start_agent,
    stop_process,
)
from kibotos_direct.supervisor import DirectSupervisor
from kibotos_firecracker import jail as jailmod
from kibotos_firecracker.api import ApiCall, FirecrackerApi
from kibotos_firecracker.backend import FirecrackerVmm
from kibotos_firecracker.launch import parse_launch
from kibotos_firecracker.vsock import connect_vsock

from kibotos.core.errors import DeadlineExceeded, FailedPrecondition, Internal, Unavailable
from kibotos.guest import open_guest_channel
from kibotos.testing.conformance import BackendFactory, check_id
from kibotos.testing.vmm_suite import VMM_GUEST_CHECKS, VmmCase, VmmCheck


@pytest.fixture
def agent_env(fc_env: FcEnv) -> Iterator[FcEnv]:
    """`fc_env` whose stand-in forwards the agent's vsock port to a real agent."""
    sock = fc_env.root / "agent.sock"
    fc_env.guest_ports[AGENT_PORT] = sock
    fc_env.write_config()
    agent = start_agent(sock, fc_env.root / "guest-root")
    try:
        yield fc_env
    finally:
        stop_process(agent)


@pytest.mark.parametrize("check", VMM_GUEST_CHECKS, ids=check_id)
async def test_conformance(check: VmmCheck, agent_env: FcEnv) -> None:
    """The guest checks of the VMM seam's suite, the jailer's unit run by ``direct``."""
    supervisor = DirectSupervisor({"state_dir": str(agent_env.root / "supervisor")})
    await check(VmmCase(BackendFactory(FirecrackerVmm, agent_env.options), agent_env.launch,
                        supervisor=supervisor, ready_timeout=TIMEOUT))


def api_socket(env: FcEnv) -> Path:
    return env.base / "firecracker" / "ins-1" / "root" / "run" / "firecracker.socket"


async def test_the_whole_launch_sequence_is_accepted(agent_env: FcEnv):
    env = agent_env
    netns = env.root / "netns-a"
    netns.write_text("")
    launch = {**env.launch, "netns_path": str(netns),
              "taps": [{"host_dev_name": "tap0", "guest_mac": "06:00:ac:10:00:02",
                        "mtu": 1500}]}
    vmm = env.backend()
    with running(vmm.unit_for(launch)):
        hello = await vmm.wait_ready(launch, timeout=TIMEOUT)
        assert hello["protocol_version"] == 1
        assert "exec" in hello["capabilities"]
        calls = env.api_calls()
        assert [f"{c['method']} {c['path']}" for c in calls if c["status"] != 400] == [
            "GET /", "PUT /machine-config", "PUT /boot-source", "PUT /drives/root",
            "PUT /drives/rw", "PUT /drives/vol0", "PUT /vsock", "PUT /balloon",
            "PUT /network-interfaces/eth0", "PUT /actions"]
        assert all(c["status"] in (200, 204) for c in calls), calls
        async with FirecrackerApi(api_socket(env), trio.current_time() + TIMEOUT) as api:
            config = await api.call(ApiCall("GET", "/vm/config"))
            info = await api.call(ApiCall("GET", "/"))
        assert info["state"] == "Running"
        assert [(d["drive_id"], d["path_on_host"], d["is_read_only"])
                for d in config["drives"]] == [("root", "/rootfs.img", True),
                                               ("rw", "/rw.img", False),
                                               ("vol0", "/vol0.img", False)]
        assert config["machine-config"]["vcpu_count"] == 2
        assert config["network-interfaces"][0]["host_dev_name"] == "tap0"
    facts = env.jailer_facts()
    assert facts["cgroup_action"] == "none"
    assert facts["args"]["netns"] == str(netns)
    assert (facts["uid"], facts["gid"]) == (VMM_UID, VMM_GID)
    # the jail as Firecracker found it: a private copy of the binary, sockets it made
    chroot = Path(facts["chroot"])
    assert (chroot / "firecracker").read_bytes() == env.firecracker.read_bytes()
    assert (chroot / "firecracker").stat().st_ino != env.firecracker.stat().st_ino
    assert api_socket(env).stat().st_uid == VMM_UID


async def test_a_second_wait_ready_only_waits_for_the_hello(agent_env: FcEnv):
    env = agent_env
    vmm = env.backend()
    with running(vmm.unit_for(env.launch)):
        first = await vmm.wait_ready(env.launch, timeout=TIMEOUT)
        before = len(env.api_calls())
        again = await vmm.wait_ready(env.launch, timeout=TIMEOUT)
        assert again["boot_id"] == first["boot_id"]
        assert [c["path"] for c in env.api_calls()[before:]] == ["/"]


async def test_an_api_refusal_is_a_clear_error_naming_the_call(agent_env: FcEnv):
    env = agent_env
    vmm = env.backend()
    unit = vmm.unit_for(env.launch)
    kernel = parse_launch(env.launch).vmlinux
    kernel.chmod(0o600)  # after staging: the VMM account can no longer read it
    with running(unit), pytest.raises(FailedPrecondition) as info:
        await vmm.wait_ready(env.launch, timeout=TIMEOUT)
    error = info.value
    assert error.message.startswith("firecracker refused PUT /boot-source (400): ")
    assert "Permission denied" in error.message
    assert error.details["call"] == "PUT /boot-source"
    assert error.details["status"] == 400
    assert "/vmlinux" in error.details["fault_message"]
    assert env.api_calls()[-1]["path"] == "/boot-source"  # nothing sent after it


async def test_api_errors_carry_firecrackers_fault_message(fc_env: FcEnv):
    vmm = fc_env.backend()
    with running(vmm.unit_for(fc_env.launch)):
        async with FirecrackerApi(api_socket(fc_env), trio.current_time() + TIMEOUT) as api:
            await api.wait_answering()
            with pytest.raises(FailedPrecondition) as info:
                await api.call(ApiCall("PUT", "/drives/my-disk", {
                    "drive_id": "my-disk", "path_on_host": "/rw.img",
                    "is_root_device": False, "is_read_only": False}))
            assert info.value.message == (
                "firecracker refused PUT /drives/my-disk (400): API Resource IDs can only "
                "contain alphanumeric characters and underscores.")
            with pytest.raises(FailedPrecondition, match=r"PUT /actions .*without kernel"):
                await api.call(ApiCall("PUT", "/actions", {"action_type": "InstanceStart"}))


async def test_an_api_that_never_answers_times_out_naming_the_socket(tmp_path: Path):
    sock = tmp_path / "none.sock"
    async with FirecrackerApi(sock, trio.current_time() + 0.3) as api:
        with pytest.raises(DeadlineExceeded, match=f"API on {sock} did not answer"):
            await api.wait_answering()


async def test_a_guest_that_fails_on_the_console_ends_the_wait(fc_env: FcEnv):
    fc_env.console_text = ["kibotos-init: FAILED: no disk with serial 123"]
    fc_env.write_config()  # and no agent behind the vsock port
    vmm = fc_env.backend()
    with running(vmm.unit_for(fc_env.launch)), pytest.raises(FailedPrecondition) as info:
        await vmm.wait_ready(fc_env.launch, timeout=TIMEOUT)
    assert info.value.message == ("guest did not come up: kibotos-init: FAILED: no disk "
                                  "with serial 123")


# ----------------------------------------------------------------------------- vsock


async def test_the_vsock_handshake_waits_for_the_agent(fc_env: FcEnv):
    agent_sock = fc_env.root / "agent.sock"
    fc_env.guest_ports[AGENT_PORT] = agent_sock
    fc_env.write_config()
    vmm = fc_env.backend()
    spec = parse_launch(fc_env.launch)
    uds = vmm.jail_for(spec).vsock_socket
    with running(vmm.unit_for(fc_env.launch)):
        await vmm.configure(fc_env.launch, trio.current_time() + TIMEOUT)
        # nobody listens in the "guest" yet: Firecracker hangs up, and the client retries
        with pytest.raises(DeadlineExceeded, match=f"vsock port {AGENT_PORT} through"):
            await connect_vsock(uds, AGENT_PORT, trio.current_time() + 0.5)
        agent = None

        async def start_later() -> None:
            nonlocal agent
            await trio.sleep(0.5)
            agent = start_agent(agent_sock, fc_env.root / "guest-root")

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(start_later)
                stream = await connect_vsock(uds, AGENT_PORT, trio.current_time() + TIMEOUT)
            async with open_guest_channel(stream) as guest:
                info = await guest.wait_hello(trio.current_time() + TIMEOUT)
                assert info.protocol_version == 1
        finally:
            if agent is not None:
                stop_process(agent)


async def test_an_answer_that_is_not_ok_is_an_error(tmp_path: Path):
    path = tmp_path / "v.sock"
    listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await listener.bind(os.fspath(path))
    listener.listen(1)

    async def serve() -> None:
        conn, _ = await listener.accept()
        with conn:
            await conn.recv(64)
            await conn.send(b"NOPE\n")
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        with pytest.raises(Internal, match="unexpected answer to CONNECT 7: b'NOPE"):
            await connect_vsock(path, 7, trio.current_time() + TIMEOUT)
        nursery.cancel_scope.cancel()
    listener.close()


# ----------------------------------------------------------------------------- e2e


async def test_through_the_direct_supervisor_a_command_runs_in_the_guest(agent_env: FcEnv):
    env = agent_env
    vmm = env.backend()
    supervisor = DirectSupervisor({"state_dir": str(env.root / "supervisor")})
    unit = vmm.unit_for(env.launch)
    info = await supervisor.start(unit)
    try:
        assert info.active
        hello = await vmm.wait_ready(env.launch, timeout=TIMEOUT)
        stream = await vmm.guest_channel(env.launch, timeout=TIMEOUT)
        async with open_guest_channel(stream) as guest:
            assert (await guest.wait_hello(trio.current_time() + TIMEOUT)).boot_id == \
                hello["boot_id"]
            status, out, err = await guest.run(["sh", "-c", "echo hi; echo oops >&2"])
        assert (status.exit_code, out, err) == (0, b"hi\n", b"oops\n")
    finally:
        await supervisor.stop(unit.name, timeout=TIMEOUT)
    await vmm.release(env.launch)
    assert not vmm.jail_for(parse_launch(env.launch)).instance_dir.exists()
    assert jailmod.mounts_under(env.base) == []


async def test_the_data_plane_reaches_the_guest_through_agent_dp_sock(agent_env: FcEnv):
    """As for every backend, the data plane's socket is ``agent-dp.sock`` in the
    Instance directory: here a link to Firecracker's vsock socket, reached with the
    ``CONNECT <dataplane_vsock_port>`` handshake (a `Target` with `vsock_port`)."""
    from kibotos.dataplane.process.guests import GuestPool

    env = agent_env
    vmm = env.backend()
    assert vmm.dataplane_vsock_port == AGENT_PORT
    spec = parse_launch(env.launch)
    link = spec.runtime_dir / "agent-dp.sock"
    with running(vmm.unit_for(env.launch)):
        assert link.is_symlink()
        assert link.resolve() == vmm.jail_for(spec).vsock_socket.resolve()
        await vmm.wait_ready(env.launch, timeout=TIMEOUT)
        pool = GuestPool(connect_timeout=TIMEOUT)
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run)
            guest = await pool.channel("inst-1", link, vmm.dataplane_vsock_port)
            status, out, _ = await guest.run(["echo", "via the data plane"])
            assert (status.exit_code, out) == (0, b"via the data plane\n")
            # Without the handshake the socket is not the agent: no hello comes.
            pool.connect_timeout = 1.0
            with pytest.raises(Unavailable, match="cannot be reached"):
                await pool.channel("inst-2", link)
            nursery.cancel_scope.cancel()
