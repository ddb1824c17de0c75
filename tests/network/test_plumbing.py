"""An Instance's namespace, veth, tap and addresses: made, made again, removed, and
removed after a kill at every step (the `node.network.*` failpoints, in a process of
their own, `network_proc.py`), with nothing left: no namespace, veth, tap, address or
rule."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from netbed import SCOPE, World, network_config

from kibotos.core import failpoints
from kibotos.node.network import enforce, nft, plumbing
from kibotos.node.network.policy import NetworkPolicy
from kibotos.node.network.records import NetworkRecord, NetworkRecords
from kibotos.node.network.tap import open_tap

pytestmark = pytest.mark.root

HERE = Path(__file__).parent
SETUP_POINTS = ["node.network.after-netns", "node.network.after-veth",
                "node.network.after-tap", "node.network.after-addresses",
                "node.network.after-table"]
TEARDOWN_POINTS = ["node.network.teardown.after-devices"]
TUNGETIFF = 0x800454D2


def run_step(step: str, records: NetworkRecords, instance_id: str, world: World,
             point: str | None = None) -> int:
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    env.pop(failpoints.ENV, None)
    if point is not None:
        env[failpoints.ENV] = f"{point}=kill"
    proc = subprocess.run([sys.executable, str(HERE / "network_proc.py"), step,
                           str(records.directory), instance_id, str(world.host)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, -signal.SIGKILL), proc.stderr
    return proc.returncode


def assert_nothing_left(record: NetworkRecord, world: World, host_rules: object) -> None:
    left = plumbing.present(record, host_netns=world.host)
    assert not left.anything, left
    assert plumbing.host_veths(world.host) == []
    assert plumbing.node_namespaces(SCOPE) == []
    assert nft.ruleset(world.host, "host rules") == host_rules  # the host table untouched


def test_the_failpoints_are_known():
    assert set(SETUP_POINTS + TEARDOWN_POINTS) <= set(failpoints.KNOWN)
    used = set()
    for module in ("plumbing", "enforce"):
        text = (Path(plumbing.__file__).parent / f"{module}.py").read_text()
        used |= {p for p in failpoints.KNOWN if f'"{p}"' in text}
    assert set(SETUP_POINTS + TEARDOWN_POINTS) <= used


def test_setup_makes_every_object_and_teardown_removes_them_twice_over(world, tmp_path):
    records, config = NetworkRecords(tmp_path), network_config()
    record = records.allocate("inst-plumb", SCOPE, config, NetworkPolicy(), [])
    host_rules = nft.ruleset(world.host, "host rules")
    path = plumbing.setup(record, host_netns=world.host)
    assert plumbing.setup(record, host_netns=world.host) == path  # a retry changes nothing
    enforce.write_table(records, record, config, [])
    made = plumbing.present(record, host_netns=world.host)
    assert made.netns
    assert made.host_veth
    assert made.ns_devices == ("tap0", "veth0")
    assert set(made.host_addresses) == {str(record.slot.v4.host), str(record.slot.v6.host)}
    assert [t["table"]["name"] for t in nft.ruleset(path, "slot table") if "table" in t] == [
        "kibotos"]
    removed = plumbing.teardown(record.names, host_netns=world.host)
    assert removed == ["tap0 in " + record.names.netns, "veth0 in " + record.names.netns,
                       str(path)]  # the host end went with its peer
    assert plumbing.teardown(record.names, host_netns=world.host) == []
    assert_nothing_left(record, world, host_rules)


def test_teardown_with_a_descriptor_still_on_the_tap_leaves_nothing(world, tmp_path):
    records = NetworkRecords(tmp_path)
    record = records.allocate("inst-openfd", SCOPE, network_config(), NetworkPolicy(), [])
    host_rules = nft.ruleset(world.host, "host rules")
    path = plumbing.setup(record, host_netns=world.host)
    fd = open_tap(path, record.names.tap)  # what QEMU holds while it runs
    try:
        plumbing.teardown(record.names, host_netns=world.host)
        assert_nothing_left(record, world, host_rules)
    finally:
        os.close(fd)


def test_an_unprivileged_process_uses_the_tap_descriptor_the_node_opened(world, tmp_path):
    records = NetworkRecords(tmp_path)
    record = records.allocate("inst-tapfd", SCOPE, network_config(), NetworkPolicy(), [])
    path = plumbing.setup(record, host_netns=world.host)
    fd = open_tap(path, record.names.tap)
    try:
        # nobody, no capabilities, in the host's namespace: asks the tap its name and
        # writes one frame into it (a virtio-net header of zeros and a broadcast frame)
        code = ("import fcntl, os, struct\n"
                f"name = fcntl.ioctl({fd}, {TUNGETIFF}, bytes(40))[:16].rstrip(b'\\0')\n"
                "assert name == b'tap0', name\n"
                f"os.write({fd}, bytes(10) + b'\\xff' * 6 + bytes(6) + b'\\x88\\xb5' + bytes(46))\n"
                "print(os.getuid(), name.decode())\n")
        out = subprocess.run(["/usr/bin/python3", "-c", code], pass_fds=[fd], user=65534,
                             group=65534, extra_groups=[], capture_output=True, text=True,
                             timeout=60, check=True).stdout
        assert out.split() == ["65534", "tap0"]
    finally:
        os.close(fd)
        plumbing.teardown(record.names, host_netns=world.host)


def test_an_empty_mount_point_left_by_a_crash_is_bound_or_removed(world, tmp_path):
    records = NetworkRecords(tmp_path)
    record = records.allocate("inst-empty", SCOPE, network_config(), NetworkPolicy(), [])
    path = record.names.netns_path()
    path.parent.mkdir(exist_ok=True)
    path.touch()  # a crash between the mount point and the bind
    assert plumbing.teardown(record.names, host_netns=world.host) == [str(path)]
    path.touch()
    assert plumbing.setup(record, host_netns=world.host) == path
    assert plumbing.present(record, host_netns=world.host).ns_devices == ("tap0", "veth0")
    plumbing.teardown(record.names, host_netns=world.host)
    assert not path.exists()


@pytest.mark.parametrize("point", SETUP_POINTS)
def test_a_setup_killed_at_each_step_leaves_nothing_after_teardown(world, tmp_path, point):
    records, instance_id = NetworkRecords(tmp_path), "inst-killed"
    host_rules = nft.ruleset(world.host, "host rules")
    assert run_step("setup", records, instance_id, world, point) == -signal.SIGKILL
    record = records.read(instance_id)
    assert record is not None  # written before any object, so it names them all
    assert plumbing.present(record, host_netns=world.host).anything
    assert run_step("teardown", records, instance_id, world) == 0
    assert records.read(instance_id) is None
    assert_nothing_left(record, world, host_rules)


@pytest.mark.parametrize("point", SETUP_POINTS)
def test_a_setup_killed_at_each_step_is_finished_by_a_retry(world, tmp_path, point):
    records, instance_id = NetworkRecords(tmp_path), "inst-retried"
    assert run_step("setup", records, instance_id, world, point) == -signal.SIGKILL
    first = records.read(instance_id)
    assert run_step("setup", records, instance_id, world) == 0
    record = records.read(instance_id)
    assert first is not None
    assert record is not None
    assert record.slot == first.slot  # the same slot, so the same addresses
    made = plumbing.present(record, host_netns=world.host)
    assert made.netns
    assert made.host_veth
    assert made.ns_devices == ("tap0", "veth0")
    assert record.facts.uplink_addresses == ("198.18.0.2", "2001:2::2")
    plumbing.teardown(record.names, host_netns=world.host)


@pytest.mark.parametrize("point", TEARDOWN_POINTS)
def test_a_teardown_killed_at_each_step_is_finished_by_the_next(world, tmp_path, point):
    records, instance_id = NetworkRecords(tmp_path), "inst-halfgone"
    host_rules = nft.ruleset(world.host, "host rules")
    assert run_step("setup", records, instance_id, world) == 0
    record = records.read(instance_id)
    assert record is not None
    assert run_step("teardown", records, instance_id, world, point) == -signal.SIGKILL
    assert records.read(instance_id) is not None  # the record goes last
    assert run_step("teardown", records, instance_id, world) == 0
    assert_nothing_left(record, world, host_rules)

