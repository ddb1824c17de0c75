"""`serve_node` in process against `FakeCtrl`: startup order, incarnations, reports on a
memory-tight flip, the owner lock, READY=1 to systemd, and the isolate ending."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path
from typing import Any

import pytest
import trio
from node_helpers import (
    Conn,
    FakeCtrl,
    RecordingInstances,
    node_config,
    store_identity,
    write_proc,
)

from kibotos.core.errors import FailedPrecondition
from kibotos.node.instances.contract import Holdings
from kibotos.node.serve import NodeRuntime, serve_node
from kibotos.node.session.control import NodeIsolated, SessionTiming

TIMING = SessionTiming(ping_interval=0.05, backoff_initial=0.02, backoff_cap=0.1)


async def _start(nursery: trio.Nursery, config: Any, **kwargs: Any) -> NodeRuntime:
    runtime: NodeRuntime = await nursery.start(
        lambda task_status: serve_node(config, timing=TIMING, task_status=task_status,
                                       **kwargs))
    return runtime


async def test_start_session_and_restart_with_a_new_incarnation(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as outer:
            fake = await outer.start(FakeCtrl().serve)
            config = node_config(tmp_path, ctrl_url=fake.ctrl_url)
            store_identity(config)
            for expected in (1, 2):
                async with trio.open_nursery() as nursery:
                    runtime = await _start(nursery, config)
                    assert runtime.incarnation == expected
                    await runtime.session.status.wait_until(lambda s: s.connected)
                    nursery.cancel_scope.cancel()
            outer.cancel_scope.cancel()
    assert [c.hello["incarnation"] for c in fake.conns] == [1, 2]
    root = tmp_path / "root"
    assert (root / "state" / "incarnation").read_text() == "2\n"
    for name in ("pki", "state", "runtime", "installations", "template-cache", "network",
                 "machine-logs"):
        assert (root / name).is_dir()
    assert (tmp_path / "pool-a" / "volumes").is_dir()


async def test_memory_tight_flip_is_reported_at_once(tmp_path: Path) -> None:
    reports: list[dict[str, Any]] = []
    got = trio.Event()

    async def script(conn: Conn) -> None:
        nonlocal got
        await conn.send(type="welcome", session_id="ses-1")
        while True:
            reports.append(await conn.receive_type("report"))
            got.set()
            got = trio.Event()

    with trio.fail_after(60):
        async with trio.open_nursery() as outer:
            fake = await outer.start(FakeCtrl(script).serve)
            config = node_config(tmp_path, ctrl_url=fake.ctrl_url)
            store_identity(config)
            async with trio.open_nursery() as nursery:
                runtime = await _start(nursery, config, sample_interval=0.02)
                await runtime.session.status.wait_until(lambda s: s.connected)
                assert fake.conns[0].hello["report"]["memory_tight"] is False
                write_proc(config.host.proc_root, available_kb=900, total_kb=10000)  # 9 %
                await got.wait()
                write_proc(config.host.proc_root, available_kb=1600, total_kb=10000)  # 16 %
                await got.wait()
                nursery.cancel_scope.cancel()
            outer.cancel_scope.cancel()
    assert [r["memory_tight"] for r in reports] == [True, False]
    assert reports[0]["memory_tight_since"] is not None
    assert reports[1]["memory_tight_since"] is None


async def test_count_change_is_reported_at_once(tmp_path: Path) -> None:
    got: list[dict[str, Any]] = []
    arrived = trio.Event()

    async def script(conn: Conn) -> None:
        await conn.send(type="welcome", session_id="ses-1")
        got.append(await conn.receive_type("report"))
        arrived.set()
        while True:
            await conn.receive()

    instances = RecordingInstances()
    with trio.fail_after(60):
        async with trio.open_nursery() as outer:
            fake = await outer.start(FakeCtrl(script).serve)
            config = node_config(tmp_path, ctrl_url=fake.ctrl_url)
            store_identity(config)
            async with trio.open_nursery() as nursery:
                runtime = await _start(nursery, config, instances=instances)
                await runtime.session.status.wait_until(lambda s: s.connected)
                instances.set_holdings(Holdings(allocated_cpu_millis=1000,
                                                allocated_memory_bytes=2**30,
                                                instance_count=1, volume_count=2))
                await arrived.wait()
                nursery.cancel_scope.cancel()
            outer.cancel_scope.cancel()
    (report,) = got
    assert report["allocated"] == {"cpu_millis": 1000, "memory_bytes": 2**30}
    assert (report["instance_count"], report["volume_count"]) == (1, 2)


async def test_second_node_on_the_same_root_is_refused(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as outer:
            fake = await outer.start(FakeCtrl().serve)
            config = node_config(tmp_path, ctrl_url=fake.ctrl_url)
            store_identity(config)
            async with trio.open_nursery() as nursery:
                await _start(nursery, config)
                with pytest.raises(FailedPrecondition, match="another node process holds"):
                    await serve_node(config)
                nursery.cancel_scope.cancel()
            outer.cancel_scope.cancel()
    # The refused start took no incarnation.
    assert (tmp_path / "root" / "state" / "incarnation").read_text() == "1\n"


async def test_missing_pool_stops_the_start_before_any_state(tmp_path: Path) -> None:
    config = node_config(tmp_path)
    shutil.rmtree(tmp_path / "pool-a")  # initialized, then gone (not mounted)
    with pytest.raises(FailedPrecondition) as info:
        await serve_node(config)
    assert info.value.message.startswith(
        f"prepare host layout: create {tmp_path / 'pool-a'}/volumes")
    assert not (tmp_path / "root" / "state" / "incarnation").exists()


async def test_isolated_node_ends_with_node_isolated(tmp_path: Path) -> None:
    async def script(conn: Conn) -> None:
        await conn.send(type="rejected", reason="isolated", message="isolated by operator")
        await conn.ws.aclose()

    with trio.fail_after(60):
        async with trio.open_nursery() as outer:
            fake = await outer.start(FakeCtrl(script).serve)
            config = node_config(tmp_path, ctrl_url=fake.ctrl_url)
            store_identity(config)
            with pytest.raises(NodeIsolated) as info:  # not wrapped in an exception group
                await serve_node(config, timing=TIMING)
            outer.cancel_scope.cancel()
    assert info.value.exit_code == 75


async def test_ready_is_sent_to_systemd_once(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    notify_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify_path))
    sock.settimeout(60)
    monkeypatch.setenv("NOTIFY_SOCKET", str(notify_path))

    async def script(conn: Conn) -> None:
        await conn.send(type="welcome", session_id=f"ses-{conn.number}")
        if conn.number == 1:
            await conn.ws.aclose()
            return
        while True:
            await conn.receive()

    with sock, trio.fail_after(60):
        async with trio.open_nursery() as outer:
            fake = await outer.start(FakeCtrl(script).serve)
            config = node_config(tmp_path, ctrl_url=fake.ctrl_url)
            store_identity(config)
            async with trio.open_nursery() as nursery:
                runtime = await _start(nursery, config)
                assert await trio.to_thread.run_sync(sock.recv, 4096) == b"READY=1"
                await runtime.session.status.wait_until(lambda s: s.established == 2)
                nursery.cancel_scope.cancel()
            outer.cancel_scope.cancel()
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):  # one READY, not one per session
            sock.recv(4096)


def test_no_notify_socket_means_no_notify(monkeypatch: pytest.MonkeyPatch) -> None:
    from kibotos.node.serve import notify_ready

    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notify_ready()  # cysystemd would raise without the variable; this must not


def test_a_node_with_network_wires_its_egress_processes_into_its_instances(
        tmp_path: Path) -> None:
    """``[network]``: the manager's network step gets the node's egress processes, so a
    policy naming an Egress or a Resolver is admitted; an Instance manager a test gives
    gets none (and keeps refusing such a policy)."""
    from adoption_harness import build_node

    from kibotos.node.egress.wiring import NodeEgress
    from kibotos.node.network.policy import parse_policy
    from kibotos.node.serve import _egress

    network = '[network]\nipv4_pool = "10.200.0.0/24"\nuplink = "eth0"\n'
    node = build_node(tmp_path, extra=network)
    step = node.manager.launcher.network
    assert step is not None
    policy = parse_policy({"egress": {"name": "corp", "revision": 1,
                                      "address": "198.18.1.2:1080"}, "public_egress": False})
    assert "no egress process" in str(step.refusal(policy))
    egress = _egress(node.config, node.manager, lambda: "node-secret")
    assert isinstance(egress, NodeEgress)
    assert step.egress is egress
    assert step.refusal(policy) is None
    assert _egress(node.config, RecordingInstances(), lambda: None) is None
    without = build_node(tmp_path / "plain")
    assert _egress(without.config, without.manager, lambda: None) is None
