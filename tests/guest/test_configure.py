"""configure: hostname, environment defaults, DNS and Volumes, applied once and idempotent.

The agent runs with ``--root``: /etc files and mount points land in a temporary tree,
and the kernel hostname is left alone.  Mounting needs root and a real block device (an
ext4 image on a loop device).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from guest_harness import AgentProcess, ext4_loop, read_text

from kibotos.core.errors import FailedPrecondition, InvalidArgument
from kibotos.guest import Dns, GuestChannel, LaunchConfig, Volume

CONFIG = LaunchConfig(
    hostname="ws-1",
    env={"FOO": "bar", "LANG": "C.UTF-8"},
    dns=Dns(nameservers=["10.0.0.2", "fd00::53"], search=["ws.example"], options=["ndots:2"]),
    retained_filesystems=["/.kibotos/rw"],
)


async def test_configure_applies_once_then_is_a_no_op(guest: GuestChannel,
                                                      agent: AgentProcess) -> None:
    first = await guest.configure(CONFIG)
    assert first.changed
    assert set(first.actions) == {"wrote /etc/hostname", "wrote /etc/hosts",
                                  "wrote /etc/resolv.conf", "set 2 environment default(s)",
                                  "set retained file systems"}
    root = agent.root
    assert (root / "etc/hostname").read_text() == "ws-1\n"
    assert "127.0.1.1\tws-1\t# kibotos-guest" in (root / "etc/hosts").read_text()
    assert (root / "etc/resolv.conf").read_text() == (
        "# written by kibotos-guest\nnameserver 10.0.0.2\nnameserver fd00::53\n"
        "search ws.example\noptions ndots:2\n")
    _, out, _ = await guest.run(["sh", "-c", "echo $FOO $LANG"])
    assert out == b"bar C.UTF-8\n"

    mtime = (root / "etc/resolv.conf").stat().st_mtime_ns
    second = await guest.configure(CONFIG)
    assert (second.changed, second.actions) == (False, ())
    assert second.config_digest == first.config_digest
    assert (root / "etc/resolv.conf").stat().st_mtime_ns == mtime

    # Only the current DNS, as the node hands it again after a restart: only that changes.
    third = await guest.configure(LaunchConfig(dns=Dns(nameservers=["10.0.0.3"])))
    assert third.actions == ("wrote /etc/resolv.conf",)
    assert third.config_digest != first.config_digest
    assert guest.hello is not None
    assert (await guest.guest_info()).config_digest == third.config_digest
    _, out, _ = await guest.run(["sh", "-c", "echo $FOO"])
    assert out == b"bar\n"  # environment defaults were left as they were


async def test_exec_environment_overrides_defaults(guest: GuestChannel) -> None:
    await guest.configure(LaunchConfig(env={"FOO": "default", "GONE": "x"}))
    _, out, _ = await guest.run(["sh", "-c", "echo $FOO ${GONE:-unset}"],
                                env={"FOO": "mine", "GONE": None})
    assert out == b"mine unset\n"


async def test_hosts_file_keeps_other_lines(guest: GuestChannel, agent: AgentProcess) -> None:
    hosts = agent.root / "etc/hosts"
    hosts.parent.mkdir(parents=True)
    hosts.write_text("127.0.0.1\tlocalhost\n10.1.1.1\tdb\n")
    await guest.configure(LaunchConfig(hostname="a"))
    await guest.configure(LaunchConfig(hostname="b"))
    assert hosts.read_text() == ("127.0.0.1\tlocalhost\n10.1.1.1\tdb\n"
                                 "127.0.1.1\tb\t# kibotos-guest\n")


@pytest.mark.parametrize(("config", "match"), [
    (LaunchConfig(hostname="bad_host!"), "invalid hostname"),
    (LaunchConfig(env={"1X": "y"}), "'env'"),
    (LaunchConfig(dns=Dns(nameservers=["not-an-ip"])), "not an IP address"),
    (LaunchConfig(dns=Dns(nameservers=["1.1.1.1"] * 4)), "at most 3"),
    (LaunchConfig(volumes=[Volume("/dev/null", "/data")]), "not a block device"),
    (LaunchConfig(volumes=[Volume("/dev/nope", "data")]), "absolute path"),
    (LaunchConfig(volumes=[Volume("/dev/nope", "/data", fs_type="vfat")]), "file system type"),
    (LaunchConfig(retained_filesystems=["/a/../b"]), "'..'"),
])
async def test_bad_configuration_is_refused_and_nothing_is_written(
    guest: GuestChannel, agent: AgentProcess, config: LaunchConfig, match: str
) -> None:
    full = LaunchConfig(hostname=config.hostname or "ok", env=config.env,
                        dns=config.dns or Dns(["10.0.0.2"]), volumes=config.volumes,
                        retained_filesystems=config.retained_filesystems)
    with pytest.raises(InvalidArgument, match=match):
        await guest.configure(full)
    assert list(agent.root.iterdir()) == []
    assert (await guest.guest_info()).config_digest is None


@pytest.mark.root
async def test_configure_mounts_volumes_once(guest: GuestChannel, agent: AgentProcess,
                                             tmp_path: Path) -> None:
    with ext4_loop(tmp_path) as device:
        config = LaunchConfig(volumes=[Volume(device, "/mnt/data")],
                              retained_filesystems=["/run/kibotos/rw"])
        first = await guest.configure(config)
        assert first.actions == (f"mounted {device} on /mnt/data (ext4)",
                                 "set retained file systems")
        target = agent.root / "mnt/data"
        assert target.is_mount()
        _, out, _ = await guest.run(["sh", "-c", f"echo kept > {target}/f; cat {target}/f"])
        assert out == b"kept\n"

        again = await guest.configure(config)
        assert (again.changed, again.actions) == (False, ())
        mounts = read_text("/proc/self/mountinfo").count(f" {target} ")
        assert mounts == 1

        # Another device where this one is mounted is refused, not stacked.
        with ext4_loop(tmp_path, "other") as other, pytest.raises(FailedPrecondition,
                                                                  match="already has"):
            await guest.configure(LaunchConfig(volumes=[Volume(other, "/mnt/data")]))
