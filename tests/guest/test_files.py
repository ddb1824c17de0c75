"""The ``files`` requests against the real agent process (paths resolve under its
``--root``): metadata operations, single files and tar trees both ways, digests, and
the failures that must leave nothing half-written (ENOSPC on a 1 MiB tmpfs, permission
denied for an unprivileged agent, a missing path, a digest mismatch, a cancel)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from guest_harness import TIMEOUT, AgentProcess, connected, wait_until

from kibotos.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from kibotos.guest import GuestChannel
from kibotos.guest.files import GuestFiles, TransferResult

NEEDS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mount, setpriv)")


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def leftovers(directory: Path) -> list[str]:
    """Temporary files or staging directories an upload may have left."""
    return sorted(n for n in os.listdir(directory) if "kibotos" in n)


async def upload(files: GuestFiles, path: str, data: bytes, digest: str | None = None,
                 **kwargs: object) -> TransferResult:
    async with await files.open_write(path, **kwargs) as up:  # type: ignore[arg-type]
        with contextlib.suppress(trio.BrokenResourceError):  # the guest stopped: commit says why
            await up.stream.send_all(data)
        return await up.commit(digest if digest is not None else sha(data))


async def download(files: GuestFiles, path: str) -> tuple[bytes, TransferResult]:
    async with await files.open_read(path) as down:
        data = await down.stream.read_all()
        return data, await down.result()


async def tar_of(files: GuestFiles, path: str, arcname: str | None = None) -> bytes:
    async with await files.open_tar_read(path, arcname=arcname) as down:
        data = await down.stream.read_all()
        done = await down.result()
    assert (done.bytes, done.sha256) == (len(data), sha(data))
    return data


async def untar(files: GuestFiles, directory: str, data: bytes) -> TransferResult:
    async with await files.open_tar_write(directory) as up:
        with contextlib.suppress(trio.BrokenResourceError):
            await up.stream.send_all(data)
        return await up.commit(sha(data))


# ---------------------------------------------------------------------------- metadata


async def test_stat_list_mkdir_move_remove(guest: GuestChannel, agent: AgentProcess) -> None:
    files = guest.files
    root = agent.root
    assert "files" in (guest.hello.capabilities if guest.hello else ())
    entry, created = await files.mkdir("/srv/a/b", mode=0o750)
    assert created
    assert (entry.path, entry.type, entry.mode, entry.permissions) == (
        "/srv/a/b", "directory", 0o750, "drwxr-x---")
    assert (await files.mkdir("/srv/a/b"))[1] is False  # exists: not an error
    (root / "srv/a/b/f.txt").write_bytes(b"hello")
    os.utime(root / "srv/a/b/f.txt", ns=(0, 1_700_000_000_123_456_789))
    os.symlink("b/f.txt", root / "srv/a/link")
    st = await files.stat("/srv/a/b/f.txt")
    assert (st.name, st.type, st.size, st.owner, st.uid) == ("f.txt", "file", 5, "root", 0)
    assert st.modified_time == "2023-11-14T22:13:20.123456789Z"
    link = await files.stat("/srv/a/link")
    assert (link.type, link.symlink_target) == ("symlink", "b/f.txt")
    assert [e.path for e in await files.list("/srv/a")] == ["/srv/a/b", "/srv/a/link"]
    assert [e.path for e in await files.list("/srv", depth=3)] == [
        "/srv/a", "/srv/a/b", "/srv/a/b/f.txt", "/srv/a/link"]
    with pytest.raises(AlreadyExists):
        await files.mkdir("/srv/a/b/f.txt")
    with pytest.raises(FailedPrecondition, match="not a directory"):
        await files.list("/srv/a/b/f.txt")
    moved = await files.move("/srv/a/b/f.txt", "/srv/g.txt")
    assert (moved.path, (root / "srv/g.txt").read_bytes()) == ("/srv/g.txt", b"hello")
    with pytest.raises(NotFound, match=r"file_move /srv/a/b/f\.txt"):
        await files.move("/srv/a/b/f.txt", "/srv/h.txt")
    with pytest.raises(FailedPrecondition, match="not empty"):
        await files.remove("/srv/a")
    await files.remove("/srv/a", recursive=True)
    await files.remove("/srv/g.txt")
    assert os.listdir(root / "srv") == []
    with pytest.raises(NotFound):
        await files.stat("/srv/a")
    with pytest.raises(InvalidArgument, match="must not contain"):
        await files.stat("/srv/../etc")


# ---------------------------------------------------------------------------- files


async def test_upload_and_download_keep_bytes_mode_and_mtime(
        guest: GuestChannel, agent: AgentProcess) -> None:
    files = guest.files
    data = os.urandom(5 * 1024 * 1024 + 3)  # many windows and frames
    done = await upload(files, "/up/new.bin", data, mode=0o751, parents=True,
                        mtime_ns=1_600_000_000_000_000_000)
    assert (done.bytes, done.sha256) == (len(data), sha(data))
    assert done.entry is not None
    assert (done.entry.mode, done.entry.mtime_ns) == (0o751, 1_600_000_000_000_000_000)
    target = agent.root / "up/new.bin"
    assert target.read_bytes() == data
    got, result = await download(files, "/up/new.bin")
    assert got == data
    assert (result.bytes, result.sha256) == (len(data), sha(data))
    # Replacing a file keeps its mode unless told otherwise; nothing is left beside it.
    await upload(files, "/up/new.bin", b"short")
    assert (target.read_bytes(), target.stat().st_mode & 0o7777) == (b"short", 0o751)
    assert leftovers(target.parent) == []
    with pytest.raises(FailedPrecondition, match="is a directory"):
        await download(files, "/up")
    with pytest.raises(FailedPrecondition, match="is a directory"):
        await upload(files, "/up", b"x")


async def test_a_digest_mismatch_writes_nothing(guest: GuestChannel,
                                                agent: AgentProcess) -> None:
    (agent.root / "keep.txt").write_bytes(b"old")
    with pytest.raises(InvalidArgument, match="nothing was written") as caught:
        await upload(guest.files, "/keep.txt", b"new bytes", digest=sha(b"other bytes"))
    assert caught.value.details["reason"] == "digest_mismatch"
    assert caught.value.details["sha256"] == sha(b"new bytes")
    assert (agent.root / "keep.txt").read_bytes() == b"old"
    assert leftovers(agent.root) == []


async def test_missing_paths_are_not_found(guest: GuestChannel, agent: AgentProcess) -> None:
    files = guest.files
    with pytest.raises(NotFound, match="file_read /nope/x: no such file"):
        await download(files, "/nope/x")
    with pytest.raises(NotFound, match="file_write /nope/x"):
        await upload(files, "/nope/x", b"data")
    with pytest.raises(NotFound, match="tar_read /nope"):
        await tar_of(files, "/nope")
    with pytest.raises(NotFound, match="tar_write /nope"):
        await untar(files, "/nope", b"")
    assert not (agent.root / "nope").exists()


async def test_a_cancelled_or_abandoned_upload_leaves_nothing(
        guest: GuestChannel, agent: AgentProcess) -> None:
    files = guest.files
    up = await files.open_write("/half.bin")
    await up.stream.send_all(os.urandom(1 << 20))
    assert len(leftovers(agent.root)) == 1  # the temporary file, not the target
    await up.cancel()
    assert leftovers(agent.root) == []
    assert not (agent.root / "half.bin").exists()
    # The host going away mid-upload (a tree this time) cleans up as well.
    tree = await _tree_tar(agent)
    async with connected(agent) as other:
        up = await other.files.open_tar_write("/")
        await up.stream.send_all(tree[: len(tree) // 2])
        await wait_until(lambda: leftovers(agent.root), "the staging directory")
    await wait_until(lambda: not leftovers(agent.root), "the staging directory to go")
    assert not (agent.root / "tree").exists()


# ---------------------------------------------------------------------------- trees


def _make_tree(base: Path) -> None:
    (base / "tree/sub/empty").mkdir(parents=True)
    (base / "tree/secret").write_bytes(b"s" * 70_000)
    (base / "tree/run.sh").write_bytes(b"#!/bin/sh\necho hi\n")
    (base / "tree/sub/deep.txt").write_bytes(b"deep")
    os.symlink("../run.sh", base / "tree/sub/rel-link")
    os.symlink("/etc/hostname", base / "tree/abs-link")
    os.link(base / "tree/run.sh", base / "tree/hard")
    os.chmod(base / "tree/secret", 0o600)
    os.chmod(base / "tree/run.sh", 0o755)
    os.chmod(base / "tree/sub/empty", 0o700)
    os.chmod(base / "tree/sub", 0o750)
    if os.geteuid() == 0:
        os.chown(base / "tree/sub/deep.txt", 1234, 5678)
    for i, path in enumerate(sorted((base / "tree").rglob("*"))):
        os.utime(path, ns=(0, 1_500_000_000_000_000_000 + i * 1000), follow_symlinks=False)
    os.utime(base / "tree", ns=(0, 1_400_000_000_000_000_000))


def _describe(top: Path) -> dict[str, tuple[object, ...]]:
    seen = {}
    for path in [top, *sorted(top.rglob("*"))]:
        st = path.lstat()
        what: object = os.readlink(path) if path.is_symlink() else (
            path.read_bytes() if path.is_file() else "dir")
        seen[str(path.relative_to(top))] = (what, st.st_mode, st.st_mtime_ns // 1000,
                                            st.st_uid, st.st_gid)
    return seen


async def _tree_tar(agent: AgentProcess) -> bytes:
    src = agent.root / "src"
    if not src.exists():
        src.mkdir()
        _make_tree(src)
    async with connected(agent) as guest:
        return await tar_of(guest.files, "/src/tree")


async def test_a_tree_keeps_modes_mtimes_symlinks_links_and_owners(
        guest: GuestChannel, agent: AgentProcess) -> None:
    files = guest.files
    data = await _tree_tar(agent)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = tar.getnames()
    assert names[0] == "tree"
    assert "tree/sub/rel-link" in names
    (agent.root / "dst").mkdir()
    done = await untar(files, "/dst", data)
    assert done.body["members"] == len(names)
    assert [e["path"] for e in done.body["entries"]] == ["/dst/tree"]
    assert _describe(agent.root / "dst/tree") == _describe(agent.root / "src/tree")
    assert (agent.root / "dst/tree/hard").stat().st_ino == (
        agent.root / "dst/tree/run.sh").stat().st_ino
    if os.geteuid() == 0:
        assert (agent.root / "dst/tree/sub/deep.txt").stat().st_uid == 1234
    assert leftovers(agent.root / "dst") == []
    # Into an existing tree: merged, files replaced; and under another top-level name.
    (agent.root / "dst/tree/sub/deep.txt").write_bytes(b"changed")
    (agent.root / "dst/tree/mine").write_bytes(b"kept")
    await untar(files, "/dst", data)
    assert (agent.root / "dst/tree/sub/deep.txt").read_bytes() == b"deep"
    assert (agent.root / "dst/tree/mine").read_bytes() == b"kept"
    copy = await tar_of(files, "/src/tree", arcname="copy")
    await untar(files, "/dst", copy)
    assert (agent.root / "dst/copy/sub/deep.txt").read_bytes() == b"deep"


async def test_conflicting_or_unsafe_archives_change_nothing(
        guest: GuestChannel, agent: AgentProcess) -> None:
    files = guest.files
    dest = agent.root / "dst"
    (dest / "tree").mkdir(parents=True)
    (dest / "tree/run.sh").mkdir()  # where the archive has a file
    with pytest.raises(FailedPrecondition, match="cannot overwrite a directory"):
        await untar(files, "/dst", await _tree_tar(agent))
    assert os.listdir(dest / "tree") == ["run.sh"]

    def archive(*members: tuple[str, bytes | str]) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for name, body in members:
                info = tarfile.TarInfo(name)
                if isinstance(body, str):
                    info.type, info.linkname = tarfile.SYMTYPE, body
                    tar.addfile(info)
                else:
                    info.size = len(body)
                    tar.addfile(info, io.BytesIO(body))
        return buf.getvalue()

    for bad, why in [(archive(("../evil", b"x")), "leaves the destination"),
                     (archive(("/abs", b"x")), "leaves the destination"),
                     (archive(("esc", "/etc"), ("esc/passwd", b"x")), "not a directory")]:
        with pytest.raises(InvalidArgument, match=why):
            await untar(files, "/dst", bad)
    with pytest.raises(InvalidArgument, match=r"not a tar archive|bad tar"):
        await untar(files, "/dst", b"this is not a tar archive" * 100)
    assert sorted(os.listdir(dest)) == ["tree"]
    assert not (agent.root / "evil").exists()


# ---------------------------------------------------------------------------- failures


@contextlib.contextmanager
def small_tmpfs(path: Path) -> Iterator[Path]:
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@NEEDS_ROOT
async def test_a_full_disk_leaves_nothing_under_the_target_name(
        guest: GuestChannel, agent: AgentProcess) -> None:
    files = guest.files
    with small_tmpfs(agent.root / "full") as full:
        (full / "big.bin").write_bytes(b"old content")
        with pytest.raises(ResourceExhausted, match="no space left") as caught:
            await upload(files, "/full/big.bin", os.urandom(3 << 20))
        assert caught.value.details["reason"] == "no_space"
        assert "nothing was written under the target name" in caught.value.message
        assert (full / "big.bin").read_bytes() == b"old content"
        assert leftovers(full) == []
        # A tree that does not fit: the staging directory goes, the destination stays.
        src = agent.root / "src"
        src.mkdir()
        (src / "tree").mkdir()
        (src / "tree/a").write_bytes(os.urandom(600_000))
        (src / "tree/b").write_bytes(os.urandom(600_000))
        with pytest.raises(ResourceExhausted, match="no space left"):
            await untar(files, "/full", await tar_of(files, "/src/tree"))
        assert sorted(os.listdir(full)) == ["big.bin"]
        # The upload's failure reaches the sender while it is still sending.
        up = await files.open_write("/full/other.bin")

        async def send_until_refused() -> None:
            with trio.fail_after(TIMEOUT):
                while True:
                    await up.stream.send_all(bytes(1 << 20))

        with pytest.raises(trio.BrokenResourceError):
            await send_until_refused()
        assert isinstance(up.error, ResourceExhausted)
        with pytest.raises(ResourceExhausted):
            await up.commit()
        assert leftovers(full) == []


@NEEDS_ROOT
async def test_permission_denied_for_an_unprivileged_agent() -> None:
    base = Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's own tmp is closed to others
    os.chmod(base, 0o755)
    os.chown(base, 65534, 65534)  # for the agent's socket; its --root stays root's
    agent = AgentProcess(base, prefix=("setpriv", "--reuid=65534", "--regid=65534",
                                       "--clear-groups"))
    try:
        (agent.root / "mine").mkdir()
        os.chown(agent.root / "mine", 65534, 65534)
        (agent.root / "secret").write_bytes(b"root only")
        os.chmod(agent.root / "secret", 0o600)
        async with connected(agent) as guest:
            files = guest.files
            with pytest.raises(PermissionDenied, match="file_read /secret: permission denied"):
                await download(files, "/secret")
            with pytest.raises(PermissionDenied, match=r"file_write /x\.bin"):
                await upload(files, "/x.bin", b"data")
            with pytest.raises(PermissionDenied, match="tar_write /"):
                await untar(files, "/", b"")
            with pytest.raises(PermissionDenied):
                await files.mkdir("/newdir")
            done = await upload(files, "/mine/ok.bin", b"data")
            assert done.entry is not None
            assert (done.entry.uid, done.entry.owner) == (65534, "nobody")
        assert leftovers(agent.root) == []
    finally:
        agent.stop()
        log = agent.log_text()
        shutil.rmtree(base, ignore_errors=True)
    assert "Traceback" not in log


async def test_writes_are_refused_while_prepared_for_stop(guest: GuestChannel) -> None:
    await guest.stop_prepare(trio.current_time() + TIMEOUT, filesystems=[])
    with pytest.raises(FailedPrecondition, match="prepared for stop"):
        await upload(guest.files, "/x", b"x")
    with pytest.raises(FailedPrecondition, match="prepared for stop"):
        await guest.files.mkdir("/d")
    await guest.thaw()
    await upload(guest.files, "/x", b"x")


async def test_memory_stays_flat_for_a_large_transfer(guest: GuestChannel,
                                                      agent: AgentProcess) -> None:
    """128 MiB up and down, the download read slowly at first: the agent never holds
    more than a few windows, whatever the file's size."""
    size, chunk = 128 << 20, os.urandom(1 << 20)
    before = agent.status_kib("VmRSS")
    digest = hashlib.sha256()
    async with await guest.files.open_write("/big.bin") as up:
        for _ in range(size // len(chunk)):
            await up.stream.send_all(chunk)
            digest.update(chunk)
        await up.commit("sha256:" + digest.hexdigest())
    async with await guest.files.open_read("/big.bin") as down:
        await trio.sleep(0.5)  # a stalled reader: the agent must wait, not buffer
        received = 0
        async for part in down.stream:
            received += len(part)
        done = await down.result()
    assert (received, done.sha256) == (size, "sha256:" + digest.hexdigest())
    grown = agent.status_kib("VmHWM") - before
    assert grown < 32 * 1024, f"the agent's peak RSS grew by {grown} KiB"
