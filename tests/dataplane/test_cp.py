"""``kibo workspace cp``'s copy (`kibotos.cli.workspace.cp_cmds.copy`) through a data plane on
loopback to the real guest agent: files and trees in both directions with cp's
"into an existing directory, else as the name" rule, tar on stdin and stdout, and the
refusals.  The command as a process, through ctrl, is in test_exec_e2e."""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from dp_harness import TIMEOUT, in_process_plane, running_agent, target

from kibotos.cli.workspace.cp_cmds import Remote, copy, parse_side
from kibotos.core.errors import FailedPrecondition, InvalidArgument, NotFound

WS = "ws-1"


@asynccontextmanager
async def workspace(tmp_path: Path) -> AsyncIterator[tuple[str, str, Path]]:
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            with trio.fail_after(TIMEOUT):
                yield plane.url, plane.credential(operations=("files",)), agent.root


def test_sides() -> None:
    assert parse_side("ws-1:/srv/x/") == Remote("ws-1", "/srv/x")
    assert parse_side("ws-1:/") == Remote("ws-1", "/")
    assert parse_side("./ws-1:/x") == "./ws-1:/x"
    assert parse_side("local.txt") == "local.txt"
    assert parse_side("Not_An_ID:/x") == "Not_An_ID:/x"
    with pytest.raises(InvalidArgument, match="must be absolute"):
        parse_side("ws-1:relative")


async def test_a_file_in_and_out(tmp_path: Path) -> None:
    data = os.urandom(2 * 1024 * 1024 + 1)
    local = tmp_path / "local"
    local.mkdir()
    (local / "a.bin").write_bytes(data)
    os.chmod(local / "a.bin", 0o640)
    os.utime(local / "a.bin", ns=(0, 1_555_000_000_987_654_321))
    async with workspace(tmp_path) as (url, cred, root):
        (root / "srv").mkdir()
        # Into an existing directory: under its own name.
        done = await copy(url, cred, str(local / "a.bin"), Remote(WS, "/srv"))
        assert done["to"] == "ws-1:/srv/a.bin"
        st = (root / "srv/a.bin").stat()
        assert ((root / "srv/a.bin").read_bytes(), st.st_mode & 0o7777, st.st_mtime_ns) == (
            data, 0o640, 1_555_000_000_987_654_321)
        # As a new name, and back out under another.
        await copy(url, cred, str(local / "a.bin"), Remote(WS, "/srv/b.bin"))
        assert (root / "srv/b.bin").read_bytes() == data
        done = await copy(url, cred, Remote(WS, "/srv/b.bin"), str(local / "c.bin"))
        assert (local / "c.bin").read_bytes() == data
        assert (local / "c.bin").stat().st_mtime_ns == 1_555_000_000_987_654_321
        await copy(url, cred, Remote(WS, "/srv/b.bin"), str(local))
        assert (local / "b.bin").read_bytes() == data
        assert sorted(p.name for p in local.iterdir()) == ["a.bin", "b.bin", "c.bin"]


async def test_a_tree_in_and_out_with_modes_and_a_symlink(tmp_path: Path) -> None:
    src = tmp_path / "project"
    (src / "bin").mkdir(parents=True)
    (src / "bin/run").write_bytes(b"#!/bin/sh\necho hi\n")
    os.chmod(src / "bin/run", 0o755)
    os.chmod(src / "bin", 0o750)
    os.symlink("bin/run", src / "run")
    async with workspace(tmp_path) as (url, cred, root):
        (root / "srv").mkdir()
        await copy(url, cred, str(src), Remote(WS, "/srv"))  # -> /srv/project
        await copy(url, cred, str(src), Remote(WS, "/srv/renamed"))  # -> /srv/renamed
        for top in (root / "srv/project", root / "srv/renamed"):
            assert (top / "bin/run").stat().st_mode & 0o7777 == 0o755
            assert (top / "bin").stat().st_mode & 0o7777 == 0o750
            assert os.readlink(top / "run") == "bin/run"
        out = tmp_path / "out"
        out.mkdir()
        await copy(url, cred, Remote(WS, "/srv/renamed"), str(out))  # -> out/renamed
        await copy(url, cred, Remote(WS, "/srv/renamed"), str(out / "again"))
        for top in (out / "renamed", out / "again"):
            assert (top / "bin/run").read_bytes() == b"#!/bin/sh\necho hi\n"
            assert (top / "bin").stat().st_mode & 0o7777 == 0o750
            assert os.readlink(top / "run") == "bin/run"
        assert not [p for p in out.iterdir() if "kibo" in p.name]
        with pytest.raises(FailedPrecondition, match="not a directory"):
            await copy(url, cred, str(src), Remote(WS, "/srv/project/run"))
        with pytest.raises(NotFound, match="does not exist"):
            await copy(url, cred, str(tmp_path / "missing"), Remote(WS, "/srv"))
        with pytest.raises(NotFound):
            await copy(url, cred, Remote(WS, "/srv/missing"), str(out))
        with pytest.raises(NotFound, match="local directory"):
            await copy(url, cred, Remote(WS, "/srv/renamed"), str(tmp_path / "no/such"))


async def test_tar_on_stdin_and_stdout(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("hello/world.txt")
        info.size, info.mode = 5, 0o600
        tar.addfile(info, io.BytesIO(b"world"))
    async with workspace(tmp_path) as (url, cred, root):
        (root / "srv").mkdir()
        r, w = os.pipe()
        os.write(w, buf.getvalue())
        os.close(w)
        try:
            await copy(url, cred, "-", Remote(WS, "/srv"), stdin_fd=r)
        finally:
            os.close(r)
        assert (root / "srv/hello/world.txt").read_bytes() == b"world"
        assert (root / "srv/hello/world.txt").stat().st_mode & 0o777 == 0o600
        out = tmp_path / "out.tar"
        fd = os.open(out, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            done = await copy(url, cred, Remote(WS, "/srv/hello"), "-", stdout_fd=fd)
        finally:
            os.close(fd)
        with tarfile.open(out) as tar:
            assert tar.getnames() == ["hello", "hello/world.txt"]
        assert done["bytes"] == out.stat().st_size
