"""The ``direct`` supervisor applies a unit's identity properties for real: the user,
no capabilities and no way to gain them, and the network namespace."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest
import trio

from kibotos.backends import UnitSpec
from kibotos.core.errors import InvalidArgument
from kibotos.plugins import load_plugins
from kibotos.testing.accounts import ensure_system_user

pytestmark = pytest.mark.root


def status_fields(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


async def running_pid(sup, name: str) -> int:
    with trio.fail_after(30):
        while True:
            info = await sup.describe(name)
            if info is not None and info.active and info.main_pid:
                return info.main_pid
            await trio.sleep(0.05)


@pytest.fixture
def sup(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root")
    return load_plugins().supervisor.get("direct")({"state_dir": str(tmp_path / "units")})


async def test_a_unit_runs_as_its_user_without_capabilities(sup, tmp_path):
    account = ensure_system_user()
    name = f"kbt-confine-{uuid.uuid4().hex[:6]}"
    await sup.start(UnitSpec(name=name, argv=["/bin/sleep", "60"], properties={
        "User": account.pw_name, "NoNewPrivileges": True, "CapabilityBoundingSet": []}))
    try:
        fields = status_fields(await running_pid(sup, name))
        assert fields["Uid"].split() == [str(account.pw_uid)] * 4
        assert fields["Gid"].split() == [str(account.pw_gid)] * 4
        assert fields["Groups"].strip() == ""
        for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(fields[cap], 16) == 0, cap
        assert fields["NoNewPrivs"].strip() == "1"
    finally:
        await sup.stop(name, timeout=5)


async def test_root_with_an_empty_bounding_set_has_no_capabilities(sup):
    name = f"kbt-confine-{uuid.uuid4().hex[:6]}"
    await sup.start(UnitSpec(name=name, argv=["/bin/sleep", "60"], properties={
        "CapabilityBoundingSet": ["CAP_NET_BIND_SERVICE"]}))
    try:
        fields = status_fields(await running_pid(sup, name))
        assert fields["Uid"].split()[0] == "0"
        assert int(fields["CapEff"], 16) == 1 << 10  # CAP_NET_BIND_SERVICE only
        assert int(fields["CapBnd"], 16) == 1 << 10
    finally:
        await sup.stop(name, timeout=5)


@pytest.fixture
def netns():
    name = f"kbt-confine-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    yield f"/run/netns/{name}"
    subprocess.run(["ip", "netns", "del", name], check=True)


async def test_a_unit_joins_its_network_namespace(sup, netns):
    name = f"kbt-confine-{uuid.uuid4().hex[:6]}"
    await sup.start(UnitSpec(name=name, argv=["/bin/sleep", "60"], properties={
        "NetworkNamespacePath": netns}))
    try:
        await running_pid(sup, name)
        info = await sup.describe(name)
        assert info is not None
        assert info.netns_inode == os.stat(netns).st_ino
    finally:
        await sup.stop(name, timeout=5)


@pytest.mark.parametrize(("properties", "message"), [
    ({"User": "no-such-user-kbt"}, "no user 'no-such-user-kbt'"),
    ({"CapabilityBoundingSet": ["CAP_NOPE"]}, "unknown capability 'CAP_NOPE'"),
    ({"AmbientCapabilities": ["CAP_NET_RAW"]}, "raises no ambient capabilities"),
    ({"NoNewPrivileges": "maybe"}, "NoNewPrivileges must be a boolean"),
    ({"NetworkNamespacePath": "relative"}, "must be an absolute path"),
])
async def test_bad_identity_properties_are_refused_before_anything_starts(
        sup, tmp_path, properties, message):
    with pytest.raises(InvalidArgument, match=message):
        await sup.start(UnitSpec(name="kbt-bad", argv=["/bin/true"], properties=properties))
    assert await sup.describe("kbt-bad") is None
