"""The storage root layout, the pool directories and the owner lock."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from node_helpers import node_config

from kibotos.core.errors import FailedPrecondition
from kibotos.node.host.layout import ROOT_DIRS, NodePaths, OwnerLock, prepare_layout


def test_prepare_layout_creates_root_and_pool_directories(tmp_path: Path) -> None:
    config = node_config(tmp_path)
    paths = prepare_layout(config)
    assert paths == NodePaths(tmp_path / "root")
    for name in ROOT_DIRS:
        assert (tmp_path / "root" / name).is_dir()
    assert (tmp_path / "pool-a" / "volumes").is_dir()
    assert (tmp_path / "pool-a" / "retained-layers").is_dir()
    prepare_layout(config)  # a second start finds everything in place


def test_missing_pool_directory_fails_with_the_spec_message(tmp_path: Path) -> None:
    config = node_config(tmp_path)
    shutil.rmtree(tmp_path / "pool-a")  # initialized, then gone (not mounted)
    with pytest.raises(FailedPrecondition) as info:
        prepare_layout(config)
    assert info.value.message.startswith(
        f"prepare host layout: create {tmp_path / 'pool-a'}/volumes")
    assert not (tmp_path / "pool-a").exists()  # never created by the node


def test_root_that_is_a_file_is_refused(tmp_path: Path) -> None:
    config = node_config(tmp_path)
    (tmp_path / "root").write_text("")
    with pytest.raises(FailedPrecondition, match="is not a directory"):
        prepare_layout(config)


def test_owner_lock_refuses_a_second_holder(tmp_path: Path) -> None:
    lock_path = tmp_path / "node.lock"
    with OwnerLock(lock_path):
        assert lock_path.read_text().strip() == str(os.getpid())
        with pytest.raises(FailedPrecondition, match="another node process holds") as info:
            OwnerLock(lock_path).acquire()
        assert f"pid {os.getpid()}" in info.value.message
    with OwnerLock(lock_path):  # released: a new holder gets it
        pass


def test_owner_lock_held_by_another_process(tmp_path: Path) -> None:
    lock_path = tmp_path / "node.lock"
    with subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys, time\n"
         f"fd = os.open({str(lock_path)!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\n"
         "os.write(fd, b'%d\\n' % os.getpid())\n"
         "print('locked', flush=True)\n"
         "sys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline().strip() == "locked"
            with pytest.raises(FailedPrecondition, match=f"pid {holder.pid}"):
                OwnerLock(lock_path).acquire()
        finally:
            assert holder.stdin is not None
            holder.stdin.close()
            holder.wait(timeout=30)
    with OwnerLock(lock_path):  # the kernel dropped the lock with the process
        pass
