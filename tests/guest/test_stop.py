"""stop_prepare, sync and thaw: ending managed processes, syncing and freezing file systems.

Freezing needs root and a real file system; every frozen file system here is an ext4
image on a loop device (or a tmpfs, which cannot be frozen), never the host's own.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import pytest
import trio
from guest_harness import GUEST_PYTHON, AgentProcess, ext4_loop, pid_alive, run, wait_until
from test_exec import read_until

from kibotos.core.errors import FailedPrecondition
from kibotos.guest import GuestChannel, GuestStopFailed, LaunchConfig, Volume
from kibotos.guest.agent import FIFREEZE, FITHAW

STUBBORN = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(1000)")


def is_frozen(path: Path) -> bool:
    """Probe with our own FIFREEZE: EBUSY means someone else holds it frozen."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, FIFREEZE, 0)
    except OSError as e:
        if e.errno != errno.EBUSY:
            raise
        return True
    else:
        fcntl.ioctl(fd, FITHAW, 0)
        return False
    finally:
        os.close(fd)


async def test_stop_prepare_kills_what_ignores_sigterm_at_the_deadline(
    guest: GuestChannel,
) -> None:
    stubborn = await guest.exec([GUEST_PYTHON, "-c", STUBBORN])
    polite = await guest.exec(["sleep", "1000"])
    assert stubborn.stdout is not None
    await read_until(stubborn.stdout, b"ready")

    with pytest.raises(GuestStopFailed) as caught:
        await guest.stop_prepare(trio.current_time() + 1.0, filesystems=[])
    err = caught.value
    assert err.reason == "deadline_exceeded"
    assert str(err).startswith("prepare guest stop: deadline_exceeded: 1 managed process")
    assert err.details["killed"] == [stubborn.pid]
    assert err.details["ended"] == [polite.pid]
    assert (await stubborn.wait()).signal == 9
    assert (await polite.wait()).signal == 15

    # Prepared for stop: no new processes until thaw.
    assert (await guest.guest_info()).stopping
    with pytest.raises(FailedPrecondition, match="thaw"):
        await guest.exec(["true"])
    assert await guest.thaw() == ()
    status, _, _ = await guest.run(["true"])
    assert status.exit_code == 0


async def test_stop_prepare_ends_the_whole_session(guest: GuestChannel) -> None:
    proc = await guest.exec(["sh", "-c", "sleep 1000 & echo $!; wait"])
    assert proc.stdout is not None
    child = int(await read_until(proc.stdout, b"\n"))
    result = await guest.stop_prepare(trio.current_time() + 30, filesystems=[])
    assert {proc.pid, child} <= set(result.ended)
    assert not pid_alive(child)
    await proc.wait()


async def test_stop_prepare_with_nothing_running(guest: GuestChannel) -> None:
    result = await guest.stop_prepare(trio.current_time() + 5, filesystems=[])
    assert (result.ended, result.synced, result.frozen) == ((), (), ())


async def test_sync_failure_is_reported(guest: GuestChannel, agent: AgentProcess) -> None:
    (agent.root / "not/mounted").mkdir(parents=True)
    with pytest.raises(GuestStopFailed) as caught:
        await guest.stop_prepare(trio.current_time() + 5, filesystems=["/not/mounted"])
    assert caught.value.reason == "retained filesystem sync failed"
    assert "/not/mounted: not a mount point" in str(caught.value)
    assert caught.value.frozen == ()


async def test_short_sync(guest: GuestChannel) -> None:
    await guest.sync(timeout=30)


@pytest.mark.root
async def test_stop_prepare_syncs_and_freezes_volumes_until_thaw(
    guest: GuestChannel, agent: AgentProcess, tmp_path: Path
) -> None:
    with ext4_loop(tmp_path) as device:
        await guest.configure(LaunchConfig(volumes=[Volume(device, "/mnt/data")]))
        target = agent.root / "mnt/data"
        status, _, _ = await guest.run(["sh", "-c", f"echo on-disk > {target}/f"])
        assert status.exit_code == 0
        writer = await guest.exec(["sh", "-c", f"while :; do echo x >> {target}/log; "
                                   "sleep 0.01; done"])

        result = await guest.stop_prepare(trio.current_time() + 30)  # retained by default
        assert (result.synced, result.frozen) == (("/mnt/data",), ("/mnt/data",))
        assert writer.pid in result.ended
        assert is_frozen(target)
        assert (await guest.guest_info()).frozen_filesystems == ("/mnt/data",)
        # Synced: the block device itself already holds the file.
        assert run("debugfs", "-R", "cat /f", device) == "on-disk\n"

        again = await guest.stop_prepare(trio.current_time() + 30)  # idempotent
        assert again.frozen == ("/mnt/data",)

        assert await guest.thaw() == ("/mnt/data",)
        assert not is_frozen(target)
        status, _, _ = await guest.run(["sh", "-c", f"echo more >> {target}/f"])
        assert status.exit_code == 0


@pytest.mark.root
async def test_freeze_failure_leaves_the_others_frozen(
    guest: GuestChannel, agent: AgentProcess, tmp_path: Path
) -> None:
    tmpfs = agent.root / "mnt/scratch"
    tmpfs.mkdir(parents=True)
    run("mount", "-t", "tmpfs", "scratch", str(tmpfs))
    try:
        with ext4_loop(tmp_path) as device:
            await guest.configure(LaunchConfig(volumes=[Volume(device, "/mnt/data")],
                                               retained_filesystems=["/mnt/scratch"]))
            with pytest.raises(GuestStopFailed) as caught:
                await guest.stop_prepare(trio.current_time() + 10)
            err = caught.value
            assert err.reason == "retained filesystem freeze failed"
            assert "/mnt/scratch: freezing is not supported" in str(err)
            assert err.frozen == ("/mnt/data",)
            assert is_frozen(agent.root / "mnt/data")
            assert await guest.thaw() == ("/mnt/data",)
    finally:
        run("umount", str(tmpfs))


async def test_exec_keeps_running_when_detached_with_keep(agent: AgentProcess) -> None:
    from guest_harness import connected

    async with connected(agent) as guest:
        kept = await guest.exec(["sleep", "1000"], on_detach="keep")
        hung_up = await guest.exec(["sleep", "1000"])
    await wait_until(lambda: not pid_alive(hung_up.pid), "the hung-up process to end")
    assert pid_alive(kept.pid)
    # It is still managed: the next host's stop_prepare ends it.
    async with connected(agent) as guest:
        result = await guest.stop_prepare(trio.current_time() + 30, filesystems=[])
    assert kept.pid in result.ended
    assert not pid_alive(kept.pid)
