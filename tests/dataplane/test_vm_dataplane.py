"""The data plane reaching a real microVM (QEMU TCG, the cached Platform and
``kibotos-base`` Template) through the guest's second port, ``org.kibotos.agent.1`` on
``agent-dp.sock``, while the node's own channel on ``agent.sock`` stays open: the two
guest sessions do not disturb each other.  The data plane serves TLS, as a node's does:
every client verifies it against the cluster CA."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from dp_harness import Plane, in_process_plane, run_exec
from tls_harness import TestCA, supply

from kibotos.backends import UnitSpec
from kibotos.dataplane.clients.client import ExecClient
from kibotos.dataplane.process.state import Target
from kibotos.guest import open_guest_channel

pytestmark = [pytest.mark.slow, pytest.mark.qemu]

BOOT_TIMEOUT = 180  # TCG on a busy 2-core machine; a normal boot takes 5-10 s
TOOLS = ("qemu-system-x86_64", "debootstrap", "mkfs.ext4", "debugfs", "dpkg-deb",
         "apt-cache", "apt-get")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _cache_root() -> Path:
    """The VM tests' cache (tests/vm/conftest.py): built once, reused here."""
    env = os.environ.get("KIBOTOS_TEST_CACHE")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/cache/kibotos-test")
    return Path.home() / ".cache" / "kibotos-test"


@pytest.fixture(scope="module")
def images() -> tuple[Path, Path]:
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    missing = [t for t in TOOLS if shutil.which(t, path=path) is None]
    if os.geteuid() != 0:
        missing.append("root (debootstrap)")
    if missing:
        message = f"VM tests need {', '.join(missing)} (packaging/apt-test-deps.txt)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    from kibotos.platform.build_platform import build_platform
    from kibotos.platform.build_template import build_template, default_recipe

    root = _cache_root()
    root.mkdir(parents=True, exist_ok=True)
    return build_platform(cache_root=root), build_template(default_recipe(), cache_root=root)


@pytest.fixture
def run_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kdv-", dir="/tmp"))  # short socket paths
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@asynccontextmanager
async def running(unit: UnitSpec) -> AsyncIterator[trio.Process]:
    """The unit's argv as a child, always killed at the end (no QEMU left behind)."""
    assert unit.log_path is not None
    log = os.open(unit.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        proc = await trio.lowlevel.open_process(
            list(unit.argv), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            cwd=unit.working_directory, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                                             **unit.environment})
    finally:
        os.close(log)
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        with trio.CancelScope(shield=True):
            await proc.wait()


#: The issue's case is 1 GiB in and out (``KIBOTOS_TEST_COPY_MIB=1024``, run by hand:
#: under TCG on a loaded 2-core machine the guest moves about 2.5 MiB/s, so 1 GiB each
#: way costs some 15 minutes); CI moves 64 MiB through the same path.
COPY_SIZE = int(os.environ.get("KIBOTOS_TEST_COPY_MIB", "64")) << 20


def _random_file(path: Path, size: int) -> str:
    """`size` random bytes at `path`, written in pieces (never whole in memory); their
    sha256."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for _ in range(size // (8 << 20)):
            piece = os.urandom(8 << 20)
            digest.update(piece)
            f.write(piece)
    return digest.hexdigest()


def _file_digest(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(8 << 20):
            digest.update(piece)
    return digest.hexdigest()


async def _copy_in_and_out(plane: Plane, tmp_path: Path) -> None:
    """What ``kibo workspace cp`` does (`cp_cmds.copy`), into the guest's writable
    layer and back, `COPY_SIZE` random bytes: equal digests, and the guest's own
    ``sha256sum`` agrees."""
    from kibotos.cli.workspace.cp_cmds import Remote, copy

    digest = await trio.to_thread.run_sync(_random_file, tmp_path / "big.bin", COPY_SIZE)
    credential = plane.credential(operations=("files",))
    started = time.monotonic()
    done = await copy(plane.url, credential, str(tmp_path / "big.bin"),
                      Remote("ws-1", "/var/tmp/big.bin"), ssl_context=plane.client_tls)
    assert done["sha256"] == f"sha256:{digest}"
    print(f"{COPY_SIZE >> 20} MiB in: {time.monotonic() - started:.1f}s")
    (tmp_path / "big.bin").unlink()
    summed = await run_exec(plane, ["sha256sum", "/var/tmp/big.bin"])
    assert summed.stdout.split()[0].decode() == digest
    (tmp_path / "back").mkdir()
    credential = plane.credential(operations=("files",))  # kibo asks anew for each cp
    started = time.monotonic()
    done = await copy(plane.url, credential, Remote("ws-1", "/var/tmp/big.bin"),
                      str(tmp_path / "back"), ssl_context=plane.client_tls)
    assert done["sha256"] == f"sha256:{digest}"
    print(f"{COPY_SIZE >> 20} MiB out: {time.monotonic() - started:.1f}s")
    assert await trio.to_thread.run_sync(_file_digest, tmp_path / "back/big.bin") == digest
    await run_exec(plane, ["rm", "-f", "/var/tmp/big.bin"])


async def _tree_and_a_full_disk(plane: Plane, tmp_path: Path) -> None:
    """A directory tree into the guest and back with its modes and a symlink kept; an
    upload that does not fit (a 1 MiB tmpfs in the guest) fails as the guest's ENOSPC
    and leaves nothing under the target name, nor any temporary file."""
    from kibotos.cli.workspace.cp_cmds import Remote, copy
    from kibotos.core.errors import ResourceExhausted

    src = tmp_path / "project"
    (src / "bin").mkdir(parents=True)
    (src / "bin/run").write_bytes(b"#!/bin/sh\necho hi\n")
    os.chmod(src / "bin/run", 0o755)
    os.chmod(src / "bin", 0o750)
    os.symlink("bin/run", src / "run")
    credential = plane.credential(operations=("files",))
    await copy(plane.url, credential, str(src), Remote("ws-1", "/var/tmp"),
               ssl_context=plane.client_tls)
    seen = await run_exec(plane, ["sh", "-c", "cd /var/tmp/project && stat -c '%a %n' bin "
                                  "bin/run && readlink run && sh run"])
    assert seen.stdout == b"750 bin\n755 bin/run\nbin/run\nhi\n", seen
    out = tmp_path / "out"
    out.mkdir()
    await copy(plane.url, credential, Remote("ws-1", "/var/tmp/project"), str(out),
               ssl_context=plane.client_tls)
    assert (out / "project/bin/run").stat().st_mode & 0o7777 == 0o755
    assert (out / "project/bin").stat().st_mode & 0o7777 == 0o750
    assert os.readlink(out / "project/run") == "bin/run"

    mounted = await run_exec(plane, ["sh", "-c", "mkdir -p /mnt/small && mount -t tmpfs "
                                     "-o size=1m tmpfs /mnt/small && echo old > "
                                     "/mnt/small/big.bin"])
    assert mounted.status.exit_code == 0, mounted
    (tmp_path / "big.bin").write_bytes(os.urandom(4 << 20))
    with pytest.raises(ResourceExhausted, match="no space left"):
        await copy(plane.url, credential, str(tmp_path / "big.bin"),
                   Remote("ws-1", "/mnt/small/big.bin"), ssl_context=plane.client_tls)
    left = await run_exec(plane, ["sh", "-c", "ls -A /mnt/small; cat /mnt/small/big.bin; "
                                  "umount /mnt/small"])
    assert left.stdout == b"big.bin\nold\n", left


async def _http_through_port_forward(plane: Plane) -> None:
    """``python3 -m http.server`` in the guest (started by exec through the data plane),
    and 50 concurrent HTTP requests to it through what ``kibo workspace port-forward``
    runs (`Forwarder`): each on its own connection and guest stream."""
    from datetime import UTC, datetime

    import httpx

    from kibotos.cli.workspace.port_forward_cmds import Forwarder, Mapping, SessionSource
    from kibotos.core.errors import Unavailable
    from kibotos.dataplane.clients.client import open_exec
    from kibotos.dataplane.clients.ports_client import open_port
    from kibotos.dataplane.endpoints.exec_session import ExecRequest

    def session() -> dict[str, object]:
        credential, claims = plane.key.issue(workspace_id="ws-1", instance_id="inst-1",
                                             node_id="node-a", operations=("ports",))
        return {"dataplane_url": plane.url, "credential": credential,
                "expires_at": datetime.fromtimestamp(claims.exp, UTC).isoformat()}

    serve = ("mkdir -p /tmp/www && for i in $(seq 0 49); do echo page $i > /tmp/www/$i.txt;"
             " done && exec python3 -m http.server 8000 --bind 127.0.0.1 --directory /tmp/www")
    async with open_exec(plane.url, plane.credential(), ExecRequest(("sh", "-c", serve)),
                         ssl_context=plane.client_tls) as server, \
            trio.open_nursery() as nursery:
        nursery.start_soon(_drain_events, server)
        with trio.fail_after(BOOT_TIMEOUT):  # until the server listens (TCG: seconds)
            while True:
                try:
                    async with open_port(plane.url, session()["credential"], 8000,
                                         ssl_context=plane.client_tls):
                        break
                except Unavailable as exc:
                    if exc.details.get("reason") != "connection_refused":
                        raise
                    await trio.sleep(0.5)
        messages: list[str] = []
        forwarder = Forwarder(SessionSource(session, session()), [Mapping(0, 8000)],
                              ["127.0.0.1"], line=lambda text: None, message=messages.append,
                              tls=lambda url: plane.client_tls)
        bound = await nursery.start(forwarder.run)
        port = bound[0][1]
        pages: dict[int, bytes] = {}

        async def get(http: httpx.AsyncClient, i: int) -> None:
            resp = await http.get(f"http://127.0.0.1:{port}/{i}.txt")
            assert resp.status_code == 200
            pages[i] = resp.content

        limits = httpx.Limits(max_connections=50, max_keepalive_connections=0)
        with trio.fail_after(BOOT_TIMEOUT):
            async with httpx.AsyncClient(timeout=BOOT_TIMEOUT, limits=limits) as http, \
                    trio.open_nursery() as requests:
                for i in range(50):
                    requests.start_soon(get, http, i)
        assert pages == {i: f"page {i}\n".encode() for i in range(50)}
        assert messages == []
        await server.signal("TERM")
        nursery.cancel_scope.cancel()


async def _drain_events(ex: ExecClient) -> None:
    async for _ in ex.events():
        pass


async def test_exec_through_the_guests_second_port(images: tuple[Path, Path],
                                                   run_dir: Path, tmp_path: Path) -> None:
    from kibotos_qemu.backend import QemuVmm
    from kibotos_qemu.launch import parse_launch

    from kibotos.platform.images import create_writable_layer

    platform_dir, template_dir = images
    create_writable_layer(run_dir / "rw.img", max(1 << 30, 3 * COPY_SIZE))
    launch = {"instance_id": run_dir.name, "runtime_dir": str(run_dir),
              "platform_dir": str(platform_dir),
              "template_image": str(template_dir / "image"),
              "writable_layer": str(run_dir / "rw.img"), "memory": "256M"}
    vmm = QemuVmm({"accelerator": "tcg", "user": "root"})  # pytest's 0700 tmp dirs
    await vmm.probe()
    socket = parse_launch(launch).dataplane_socket
    assert socket == run_dir / "agent-dp.sock"
    async with running(vmm.unit_for(launch)):
        await vmm.wait_ready(launch, timeout=BOOT_TIMEOUT)
        stream = await vmm.guest_channel(launch)
        async with open_guest_channel(stream) as node_channel:
            await node_channel.wait_hello(trio.current_time() + 30)
            sleeper = await node_channel.exec(["sleep", "600"])
            ca = TestCA()
            async with in_process_plane(tmp_path, client_tls=ca.client) as plane:
                await supply(plane.control, *ca.pair())
                await plane.hand_state(Target("inst-1", socket, "ws-1"))
                with trio.fail_after(BOOT_TIMEOUT):
                    result = await run_exec(plane, ["sh", "-c", "echo hi; cat; exit 5"],
                                            stdin=b"through org.kibotos.agent.1\n")
                assert result.status.exit_code == 5
                assert result.stdout == b"hi\nthrough org.kibotos.agent.1\n"
                with trio.fail_after(BOOT_TIMEOUT * 2 + COPY_SIZE / (256 << 10)):
                    await _copy_in_and_out(plane, tmp_path)
                with trio.fail_after(BOOT_TIMEOUT * 2):
                    await _tree_and_a_full_disk(plane, tmp_path)
                with trio.fail_after(BOOT_TIMEOUT * 2):
                    await _http_through_port_forward(plane)
                # The node's session on the first port was not reset by the data plane's.
                probe = await node_channel.run(["sh", "-c", f"kill -0 {sleeper.pid}"])
                assert probe[0].exit_code == 0
                assert sleeper.exit_status is None
            await sleeper.signal("KILL")
    console = (run_dir / "console.log").read_text(errors="replace")
    assert "kibotos-init: starting agent" in console
