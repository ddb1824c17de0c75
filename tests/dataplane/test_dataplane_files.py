"""The file endpoints through a data plane (in this process, on loopback) to the real
guest agent: credentials, metadata, files and trees both ways with their digests, and
the failures (a full disk, permission denied, a missing path, a digest mismatch, an
error after the download started) with nothing half-written in the guest."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import trio
from dp_harness import TIMEOUT, Plane, in_process_plane, running_agent, target

from kibotos.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kibotos.dataplane.clients.files_client import FilesClient
from kibotos.testing.waiting import wait_until

NEEDS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mount, setpriv)")


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


async def pieces(data: bytes, size: int = 100_000) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]
        await trio.lowlevel.checkpoint()


def leftovers(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if "kibotos" in n)


@contextlib.asynccontextmanager
async def plane_for(tmp_path: Path, **agent_kwargs: object) -> AsyncIterator[
        tuple[Plane, FilesClient, Path]]:
    with running_agent(tmp_path, **agent_kwargs) as agent:  # type: ignore[arg-type]
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            client = FilesClient(plane.url, plane.credential(operations=("files",)))
            with trio.fail_after(TIMEOUT):
                yield plane, client, agent.root


async def download(client: FilesClient, name: str, path: str, **params: object) -> bytes:
    data = bytearray()
    async with client.download(name, path, **params) as down:
        async for chunk in down.chunks():
            data += chunk
    assert down.sha256 == sha(bytes(data))
    return bytes(data)


async def test_credentials_and_endpoints(tmp_path: Path) -> None:
    async with plane_for(tmp_path) as (plane, _, root):
        (root / "f").write_bytes(b"x")
        async with httpx.AsyncClient(base_url=plane.url, timeout=TIMEOUT) as http:
            resp = await http.get("/v1/files/stat", params={"path": "/f"})
            assert (resp.status_code, resp.json()["error"]["code"]) == (401, "unauthenticated")
            exec_only = {"Authorization": f"Bearer {plane.credential()}"}
            resp = await http.get("/v1/files/stat", params={"path": "/f"}, headers=exec_only)
            assert resp.status_code == 403
            assert "does not grant 'files'" in resp.json()["error"]["message"]
            resp = await http.get("/v1/files/nope", headers=exec_only)
            assert (resp.status_code, resp.json()["error"]["code"]) == (404, "not_found")
            resp = await http.delete("/v1/files/stat", headers=exec_only)
            assert resp.status_code == 400
            files = {"Authorization": f"Bearer {plane.credential(operations=('files',))}"}
            resp = await http.get("/v1/files/stat", params={"path": "/f", "x": "1"},
                                  headers=files)
            assert resp.status_code == 400
            assert "unknown parameters ['x']" in resp.json()["error"]["message"]
            resp = await http.get("/v1/files/stat", params={"path": "relative"},
                                  headers=files)
            assert "absolute" in resp.json()["error"]["message"]
            resp = await http.get("/v1/files/stat", params={"path": "/f"}, headers=files)
            assert resp.json()["result"]["entry"]["size"] == 1
        with pytest.raises(Unauthenticated):
            await FilesClient(plane.url, None).stat("/f")
        assert plane.server is not None
        text = plane.server.metrics.text()
        assert 'kibotos_dataplane_connections_rejected_total{code="permission_denied"}' in text


async def test_metadata_operations(tmp_path: Path) -> None:
    async with plane_for(tmp_path) as (_, client, root):
        entry, created = await client.mkdir("/a/b", mode=0o700)
        assert (entry.path, entry.mode, created) == ("/a/b", 0o700, True)
        assert (await client.mkdir("/a/b"))[1] is False
        (root / "a/b/f.txt").write_bytes(b"hello")
        os.symlink("b/f.txt", root / "a/link")
        link = await client.stat("/a/link")
        assert (link.type, link.symlink_target) == ("symlink", "b/f.txt")
        assert [e.path for e in await client.list("/a", depth=2)] == [
            "/a/b", "/a/b/f.txt", "/a/link"]
        moved = await client.move("/a/b/f.txt", "/a/g.txt")
        assert moved.size == 5
        with pytest.raises(NotFound):
            await client.stat("/a/b/f.txt")
        with pytest.raises(FailedPrecondition, match="not empty"):
            await client.remove("/a")
        await client.remove("/a", recursive=True)
        assert not (root / "a").exists()


async def test_a_file_both_ways_with_mode_mtime_and_digest(tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 11)
    async with plane_for(tmp_path) as (plane, client, root):
        answer = await client.upload("content", "/up/x.bin", pieces(data), mode="0640",
                                     mtime_ns=1_600_000_000_123_456_789, parents="true")
        assert (answer["bytes"], answer["sha256"]) == (len(data), sha(data))
        st = (root / "up/x.bin").stat()
        assert (st.st_mode & 0o7777, st.st_mtime_ns) == (0o640, 1_600_000_000_123_456_789)
        assert await download(client, "content", "/up/x.bin") == data
        async with client.download("content", "/up/x.bin") as down:
            assert down.entry is not None
            assert (down.entry.size, down.size) == (len(data), len(data))
            async for _ in down.chunks():
                pass
        # A client that knows nothing of trailers gets the plain bytes.
        async with httpx.AsyncClient(base_url=plane.url, timeout=TIMEOUT) as http:
            auth = {"Authorization": f"Bearer {plane.credential(operations=('files',))}"}
            resp = await http.get("/v1/files/content", params={"path": "/up/x.bin"},
                                  headers=auth)
            assert (resp.status_code, resp.content) == (200, data)
            # A wrong digest from the client: refused by the guest, nothing replaced.
            resp = await http.put("/v1/files/content", params={"path": "/up/x.bin"},
                                  headers={**auth, "Kibotos-Sha256": sha(b"other")},
                                  content=b"new content")
            assert resp.status_code == 400
            assert resp.json()["error"]["details"]["reason"] == "digest_mismatch"
            assert (root / "up/x.bin").read_bytes() == data
            resp = await http.put("/v1/files/content", params={"path": "/up/y.bin"},
                                  headers={**auth, "Kibotos-Sha256": sha(b"plain")},
                                  content=b"plain")
            assert resp.status_code == 200, resp.text
            assert (root / "up/y.bin").read_bytes() == b"plain"
        assert leftovers(root / "up") == []
        assert plane.server is not None
        text = plane.server.metrics.text()
        assert 'kibotos_dataplane_files_bytes_total{direction="upload"}' in text
        assert 'kibotos_dataplane_files_requests_total{outcome="ok",request="content"}' in text


async def test_a_tree_with_modes_and_a_symlink(tmp_path: Path) -> None:
    async with plane_for(tmp_path) as (_, client, root):
        (root / "src/tree/sub").mkdir(parents=True)
        (root / "src/tree/run.sh").write_bytes(b"#!/bin/sh\n")
        os.chmod(root / "src/tree/run.sh", 0o755)
        os.chmod(root / "src/tree/sub", 0o700)
        os.symlink("../run.sh", root / "src/tree/sub/link")
        os.utime(root / "src/tree/run.sh", ns=(0, 1_234_567_890_123_456_789))
        tar = await download(client, "tar", "/src/tree", arcname="copy")
        with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
            assert sorted(archive.getnames()) == ["copy", "copy/run.sh", "copy/sub",
                                                  "copy/sub/link"]
        (root / "dst").mkdir()
        answer = await client.upload("tar", "/dst", pieces(tar))
        assert answer["members"] == 4
        copy = root / "dst/copy"
        assert (copy / "run.sh").stat().st_mode & 0o7777 == 0o755
        assert (copy / "run.sh").stat().st_mtime_ns == 1_234_567_890_123_456_789
        assert (copy / "sub").stat().st_mode & 0o7777 == 0o700
        assert os.readlink(copy / "sub/link") == "../run.sh"
        assert leftovers(root / "dst") == []


async def test_missing_paths(tmp_path: Path) -> None:
    async with plane_for(tmp_path) as (_, client, root):
        with pytest.raises(NotFound, match="no such file"):
            await download(client, "content", "/nope")
        with pytest.raises(NotFound):
            await client.upload("content", "/nope/x", pieces(b"data"))
        with pytest.raises(NotFound):
            await client.upload("tar", "/nope", pieces(b""))
        assert not (root / "nope").exists()


@contextlib.contextmanager
def small_tmpfs(path: Path) -> Iterator[Path]:
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@NEEDS_ROOT
async def test_a_full_guest_disk_is_507_and_leaves_nothing(tmp_path: Path) -> None:
    async with plane_for(tmp_path) as (plane, client, root):
        with small_tmpfs(root / "full") as full:
            with pytest.raises(ResourceExhausted, match="no space left") as caught:
                await client.upload("content", "/full/big.bin", pieces(os.urandom(4 << 20)))
            assert caught.value.details["reason"] == "no_space"
            assert os.listdir(full) == []
            async with httpx.AsyncClient(base_url=plane.url, timeout=TIMEOUT) as http:
                resp = await http.put(
                    "/v1/files/content", params={"path": "/full/big.bin"},
                    headers={"Authorization":
                             f"Bearer {plane.credential(operations=('files',))}"},
                    content=os.urandom(2 << 20))
            assert (resp.status_code, resp.json()["error"]["code"]) == (
                507, "resource_exhausted")
            assert os.listdir(full) == []


@NEEDS_ROOT
async def test_permission_denied_before_and_after_the_download_started() -> None:
    base = Path(tempfile.mkdtemp(dir="/tmp"))  # an unprivileged agent's socket lives here
    os.chmod(base, 0o755)
    os.chown(base, 65534, 65534)
    prefix = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
    try:
        async with plane_for(base, prefix=prefix) as (plane, client, root):
            (root / "tree/a").mkdir(parents=True)
            (root / "tree/a/open").write_bytes(os.urandom(300_000))
            (root / "tree/b-secret").write_bytes(b"root only")
            os.chmod(root / "tree/b-secret", 0o600)
            with pytest.raises(PermissionDenied, match="permission denied"):
                await download(client, "content", "/tree/b-secret")
            with pytest.raises(PermissionDenied):
                await client.upload("content", "/tree/new", pieces(b"x"))
            # The tar fails at the secret, after the first member was sent: the trailer
            # says why to a client that asked for trailers ...
            with pytest.raises(PermissionDenied, match="permission denied"):
                await download(client, "tar", "/tree")
            # ... and a client that did not sees a truncated body, never a complete one.
            auth = {"Authorization": f"Bearer {plane.credential(operations=('files',))}"}
            async with httpx.AsyncClient(base_url=plane.url, timeout=TIMEOUT) as http:
                with pytest.raises(httpx.RemoteProtocolError):
                    await http.get("/v1/files/tar", params={"path": "/tree"}, headers=auth)
            assert not (root / "tree/new").exists()
    finally:
        shutil.rmtree(base, ignore_errors=True)


async def test_a_digest_mismatch_is_refused_by_the_client(tmp_path: Path) -> None:
    """The client recomputes what arrived: a wrong trailer reads as corruption."""
    async with plane_for(tmp_path) as (_, client, root):
        (root / "f").write_bytes(b"content")
        with pytest.raises(InvalidArgument, match="path"):
            await client.stat("")
        async with client.download("content", "/f") as down:
            down._digest.update(b"tampered")  # what a corrupting hop would cause
            with pytest.raises(Exception, match="received 7 bytes with sha256:"):
                async for _ in down.chunks():
                    pass


def inotify_fds(pid: int) -> int:
    fd_dir = Path(f"/proc/{pid}/fd")
    return sum(1 for fd in fd_dir.iterdir() if os.readlink(fd) == "anon_inode:inotify")


async def test_a_watch_streams_changes_until_the_client_leaves(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            (agent.root / "w").mkdir()
            exec_only = FilesClient(plane.url, plane.credential())
            with pytest.raises(PermissionDenied, match="does not grant 'files'"):
                async with exec_only.download("watch", "/w"):
                    pass
            client = FilesClient(plane.url, plane.credential(operations=("files",)))
            with pytest.raises(InvalidArgument, match="recursive must be true or false"):
                async with client.download("watch", "/w", recursive="yes"):
                    pass
            with trio.fail_after(TIMEOUT):
                async with client.download("watch", "/w", recursive="true") as down:
                    assert down.entry is not None
                    assert down.entry.path == "/w"
                    (agent.root / "w/sub").mkdir()
                    (agent.root / "w/sub/new.txt").write_bytes(b"")
                    lines = bytearray()
                    async for chunk in down.chunks():
                        lines += chunk
                        if lines.count(b"\n") >= 2:
                            break
                assert lines.splitlines() == [b'{"name":"sub","type":"create"}',
                                              b'{"name":"sub/new.txt","type":"create"}']
                # Closing the connection ended the watch in the guest.
                await wait_until(lambda: inotify_fds(agent.proc.pid) == 0 or None,
                                 "the guest's watch to end")


async def test_a_watch_whose_guest_goes_ends_with_the_error(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            (agent.root / "w").mkdir()
            client = FilesClient(plane.url, plane.credential(operations=("files",)))
            with trio.fail_after(TIMEOUT):
                async with client.download("watch", "/w") as down:
                    await trio.to_thread.run_sync(agent.stop)
                    with pytest.raises(Unavailable):
                        async for _ in down.chunks():
                            pass
            assert plane.server is not None
            text = plane.server.metrics.text()
    assert 'kibotos_dataplane_files_requests_total{outcome="unavailable",request="watch"}' \
        in text
