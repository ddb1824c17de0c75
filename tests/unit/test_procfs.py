"""`kibotos.core.procfs`, the one reader of ``/proc``: prepared trees for the odd cases the
kernel writes (parentheses in command names, escaped mount points, stacked mounts), and
the real ``/proc`` of this test process and a child it starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kibotos.core import procfs

#: A stat line whose command name holds a space and both parentheses (``prctl`` allows it).
ODD_STAT = ("4242 (we)ird (name) S 1 4240 4239 0 -1 4194560 100 0 0 0 "
            "17 5 0 0 20 0 1 0 987654 1000 10 18446744073709551615\n")


def write_stat(proc: Path, pid: int, text: str) -> None:
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "stat").write_text(text)


def test_the_fields_after_the_command_name_are_found_from_the_last_parenthesis() -> None:
    stat = procfs.parse_stat(ODD_STAT)
    assert stat == procfs.Stat(pid=4242, comm="we)ird (name", state="S", ppid=1, pgrp=4240,
                               session=4239, utime=17, stime=5, start_time_ticks=987654)
    assert not stat.dead


@pytest.mark.parametrize("text", ["", "4242 (x) S 1 2 3", "no parentheses at all 1 2 3"])
def test_a_line_that_is_not_a_stat_line_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a /proc/<pid>/stat line"):
        procfs.parse_stat(text)


def test_a_gone_or_zombie_process_has_no_start_time(tmp_path: Path) -> None:
    write_stat(tmp_path, 4242, ODD_STAT)
    write_stat(tmp_path, 4243, ODD_STAT.replace("4242 (", "4243 (").replace(" S ", " Z "))
    write_stat(tmp_path, 4244, "garbage\n")
    assert procfs.start_time(4242, tmp_path) == 987654
    assert procfs.start_time(4243, tmp_path) is None  # a zombie
    assert procfs.read_stat(4243, tmp_path) is not None
    assert procfs.read_stat(4244, tmp_path) is None  # unreadable counts as gone
    assert procfs.read_stat(4245, tmp_path) is None  # gone
    assert procfs.pids(tmp_path) == [4242, 4243, 4244]
    assert procfs.live_group_members(4240, tmp_path) == [4242]


def test_this_process_as_the_real_proc_shows_it() -> None:
    me = procfs.read_stat(os.getpid())
    assert me is not None
    assert (me.pid, me.ppid, me.pgrp) == (os.getpid(), os.getppid(), os.getpgrp())
    assert me.state in "RS"
    assert procfs.start_time(os.getpid()) == me.start_time_ticks
    exe = procfs.executable(os.getpid())
    assert exe is not None
    assert os.path.samefile(exe[0], sys.executable)
    assert procfs.netns_inode(os.getpid()) == os.stat("/proc/self/ns/net").st_ino
    assert procfs.boot_id() == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    boot = procfs.boot_time()
    assert boot is not None
    assert 0 < boot < time.time()


def test_a_child_in_its_own_group_is_a_live_member_until_it_is_reaped() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)
    try:
        assert procfs.live_group_members(child.pid) == [child.pid]
        stat = procfs.read_stat(child.pid)
        assert stat is not None
        assert stat.session == child.pid
    finally:
        child.kill()
        child.wait()
    assert procfs.live_group_members(child.pid) == []
    assert procfs.read_stat(child.pid) is None


def test_system_stat_gives_boot_time_and_cpu_times(tmp_path: Path) -> None:
    (tmp_path / "stat").write_text("cpu  10 0 5 100 7 0 0 0 0 0\ncpu0 1 2 3 4\n"
                                   "btime 1700000000\n")
    assert procfs.cpu_times(tmp_path) == (107, 122)
    assert procfs.boot_time(tmp_path) == 1700000000.0
    (tmp_path / "stat").write_text("cpu0 1 2 3 4\nbtime soon\n")
    assert procfs.cpu_times(tmp_path) is None
    assert procfs.boot_time(tmp_path) is None


# ---------------------------------------------------------------------------- mounts

MOUNTS = (
    "/dev/vda1 / ext4 rw,relatime 0 0\n"
    "/dev/vdb1 /srv/my\\040pool xfs rw,noatime 0 0\n"
    "/dev/vdb1 /srv/my\\040pool xfs ro,noatime 0 0\n"  # stacked: the last one counts
    "nfs:/x /srv/my\\040pool/nfs nfs4 rw,vers=4.1,hard,vers=4.2 0 0\n"
    "short line\n"
)
MOUNTINFO = (
    "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
    "36 22 0:53 /export /srv/my\\040jail/a rw,nosuid shared:9 master:2 - nfs4 srv:/e rw,hard\n"
    "37 36 0:54 / /srv/my\\040jail/a/b\\134c rw - tmpfs tmpfs rw,size=64k\n"
    "38 22 0:29 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    "39 22 0:30 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,xattr,name=systemd\n"
    "40 22 0:31 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
    "not a mountinfo line\n"
)


def test_mounts_decode_escapes_and_the_last_stacked_mount_holds_a_path() -> None:
    table = procfs.parse_mounts(MOUNTS)
    assert len(table) == 4
    mount = procfs.find_mount(table, "/srv/my pool/data")
    assert mount is not None
    assert (mount.device, mount.mount_point, mount.read_only) == ("/dev/vdb1", "/srv/my pool",
                                                                  True)
    nfs = procfs.find_mount(table, "/srv/my pool/nfs")
    assert nfs is not None
    assert nfs.value("vers") == "4.2"
    assert nfs.has("hard")
    root = procfs.find_mount(table, "/srv/my poolside")  # a prefix, not a parent
    assert root is not None
    assert root.mount_point == "/"
    assert procfs.find_mount(table, "relative/path") is None


def test_mountinfo_gives_device_root_and_both_option_sets() -> None:
    table = procfs.parse_mountinfo(MOUNTINFO)
    assert [m.mount_id for m in table] == [22, 36, 37, 38, 39, 40]
    nfs = table[1]
    assert (nfs.parent_id, nfs.device, nfs.root, nfs.mount_point, nfs.fstype, nfs.source) == (
        22, "0:53", "/export", "/srv/my jail/a", "nfs4", "srv:/e")
    assert nfs.options == ("rw", "nosuid")
    assert nfs.super_options == ("rw", "hard")
    assert table[2].mount_point == "/srv/my jail/a/b\\c"
    assert procfs.mounts_under(table, "/srv/my jail") == [Path("/srv/my jail/a/b\\c"),
                                                          Path("/srv/my jail/a")]


def test_the_tables_are_read_from_the_given_proc_root(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        procfs.read_mounts(tmp_path)
    assert procfs.cgroup_mounts(tmp_path) == []
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "mounts").write_text(MOUNTS)
    (tmp_path / "self" / "mountinfo").write_text(MOUNTINFO)
    assert procfs.read_mounts(tmp_path) == procfs.parse_mounts(MOUNTS)
    assert procfs.read_mountinfo(tmp_path) == procfs.parse_mountinfo(MOUNTINFO)
    assert procfs.cgroup_mounts(tmp_path) == [Path("/sys/fs/cgroup"),
                                              Path("/sys/fs/cgroup/systemd")]


def test_the_real_mount_tables_hold_the_root() -> None:
    info = procfs.find_mount(procfs.read_mountinfo(), "/")
    mount = procfs.find_mount(procfs.read_mounts(), "/")
    assert info is not None
    assert mount is not None
    assert info.mount_point == mount.mount_point == "/"
    assert info.fstype == mount.fstype


def test_cgroup_pids_refuses_the_root_cgroup_and_lists_a_cgroup_tree(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="root cgroup"):
        procfs.cgroup_pids("/", tmp_path)
    hierarchy = tmp_path / "cg"
    (hierarchy / "app.slice" / "unit.service" / "sub").mkdir(parents=True)
    (hierarchy / "app.slice" / "unit.service" / "cgroup.procs").write_text("10\n11\n")
    (hierarchy / "app.slice" / "unit.service" / "sub" / "cgroup.procs").write_text("12\n")
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "mountinfo").write_text(
        f"38 22 0:29 / {hierarchy} rw - cgroup2 cgroup2 rw\n")
    assert procfs.cgroup_pids("/app.slice/unit.service", tmp_path) == {10, 11, 12}
    assert procfs.cgroup_pids("/app.slice/gone.service", tmp_path) == set()
