"""``kibo storage-pool`` against a real ctrl process on loopback (real SQLite), with a
simulated node (`kibotos.testing.fake_node`) declaring the pool: list, get (capacity
``-`` until set), objects, set-capacity, declare-lost, their bad input and exit codes,
and the troubleshooting row "create returns resource_exhausted and get shows -"."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import click
import httpx
import trio
from cli_ctrlproc import CtrlProcess
from cli_invoke import invoke
from click.testing import Result
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kibotos.cli.cluster.pool_cmds import pool_group
from kibotos.testing.fake_node import open_sim_node
from kibotos.testing.waiting import wait_until

MARKER = "7" * 32
GI = 1 << 30


def pools() -> list[dict[str, Any]]:
    return [{"id": "pool-a", "shared": False, "default": True, "driver": "local",
             "available": True, "reason": None, "instance": MARKER, "warnings": []}]


async def kibo(config: Path, *args: str) -> Result:
    return await trio.to_thread.run_sync(lambda: invoke(config, *args))


async def kibo_json(config: Path, *args: str) -> Any:
    result = await kibo(config, *args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)["result"]


def node_credential(ctrl: CtrlProcess, node_id: str) -> str:
    public = base64.b64encode(Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw)).decode()
    response = httpx.post(f"{ctrl.url}/v1/enrollment/exchange",
                          json={"token": ctrl.grant("node", node_id), "public_key": public},
                          timeout=30, verify=ctrl.tls())
    response.raise_for_status()
    return str(response.json()["result"]["credential"])


def add_template(ctrl: CtrlProcess, operator: Path) -> None:
    credential = next(line.split("=", 1)[1].strip().strip('"')
                      for line in operator.read_text().splitlines()
                      if line.startswith("credential"))
    headers = {"Authorization": f"Bearer {credential}"}
    digests = []
    image = bytearray(4096)
    image[1080:1082] = b"\x53\xef"  # ext4 superblock magic: ctrl checks the format
    for data in (bytes(image), b"\x7fELF kernel\n", b"initramfs\n"):
        hexdigest = hashlib.sha256(data).hexdigest()
        httpx.put(f"{ctrl.url}/v1/artifacts/sha256/{hexdigest}", content=data,
                  headers=headers, timeout=30, verify=ctrl.tls()).raise_for_status()
        digests.append(f"sha256:{hexdigest}")
    httpx.put(f"{ctrl.url}/v1/templates/base", headers=headers, timeout=30,
              verify=ctrl.tls(), json={
        "image_digest": digests[0], "kernel_digest": digests[1],
        "initramfs_digest": digests[2]}).raise_for_status()


async def test_storage_pool_commands(tmp_path: Path) -> None:
    (tmp_path / "ctrl").mkdir()
    ctrl = CtrlProcess(tmp_path / "ctrl")
    # production behaviour: no [testing] pool_capacity
    ctrl.config.write_text(f'[ctrl]\nlisten = "127.0.0.1:0"\nstate_dir = "{ctrl.state_dir}"\n'
                           'reconcile_interval = "1h"\n')
    await trio.to_thread.run_sync(ctrl.start)
    try:
        operator = tmp_path / "operator" / "kibo.toml"
        enrolled = invoke(None, "enroll", *ctrl.enroll_args(), "--grant",
                          ctrl.grant("operator"), "--config", str(operator))
        assert enrolled.exit_code == 0, enrolled.stderr
        await trio.to_thread.run_sync(add_template, ctrl, operator)
        credential = await trio.to_thread.run_sync(node_credential, ctrl, "node-a")
        async with open_sim_node(ctrl.url, credential, "node-a", 1, pools=pools(),
                                 ssl_context=ctrl.tls()):
            await _walk(operator)
    finally:
        await trio.to_thread.run_sync(ctrl.stop)


async def _walk(operator: Path) -> None:
    async def eligible() -> bool:
        node = await kibo_json(operator, "node", "get", "node-a")
        return bool(node["placement"]["eligible"])

    await wait_until(eligible, "node-a eligible")

    # never set: `-`, and a create is resource_exhausted naming the command
    listed = (await kibo(operator, "storage-pool", "list")).stdout
    row = next(line for line in listed.splitlines() if "| pool-a " in line)
    assert [c.strip() for c in row.split("|")[1:-1]] == [
        "pool-a", "standalone", "-", "0B", "-", "1", "1", "NO_CAPACITY"]
    got = (await kibo(operator, "storage-pool", "get", "pool-a")).stdout
    assert "  Capacity:        -" in got
    assert f"  Marker instance: {MARKER}" in got
    assert "  node-a: available (READY, local, default)" in got
    created = await kibo(operator, "workspace", "create", "--template", "base",
                         "--layer-size", "1G")
    assert created.exit_code == 15, created.stderr
    assert "resource_exhausted" in created.stderr
    assert "kibo storage-pool set-capacity pool-a" in created.stderr

    # set it; a create fits; the object is listed with its holder and epoch
    done = await kibo(operator, "storage-pool", "set-capacity", "pool-a", "2G")
    assert done.exit_code == 0, done.stderr
    assert done.stdout.startswith("storage pool pool-a: capacity 2.0GiB, 0B reserved")
    ws = await kibo_json(operator, "workspace", "create", "--template", "base",
                         "--layer-size", "1536M", "--no-wait")
    objects = (await kibo(operator, "storage-pool", "objects", "pool-a")).stdout
    line = next(x for x in objects.splitlines() if ws["workspace_id"] in x)
    cells = [c.strip() for c in line.split("|")[1:-1]]
    assert cells[0] == "retained_layer"
    assert cells[2] == "1.5GiB"
    assert cells[5:] == ["node-a", "1"]
    pool = await kibo_json(operator, "storage-pool", "get", "pool-a")
    assert (pool["capacity_bytes"], pool["reserved_bytes"]) == (2 * GI, 3 * GI // 2)

    # refusals: below the reservations (13), bad values (10), flags (2)
    below = await kibo(operator, "storage-pool", "set-capacity", "pool-a", "1G")
    assert below.exit_code == 13
    assert "already reserved" in below.stderr
    full = await kibo(operator, "workspace", "create", "--template", "base",
                      "--layer-size", "1G")
    assert full.exit_code == 15
    assert "storage pool pool-a has 512.0MiB left" in full.stderr
    for args in (("set-capacity", "Bad_Pool", "1G"), ("set-capacity", "pool-a", "0"),
                 ("set-capacity", "pool-a", "lots"), ("get", "../x")):
        assert (await kibo(operator, "storage-pool", *args)).exit_code == 10, args
    unknown = await kibo(operator, "storage-pool", "get", "nope")
    assert unknown.exit_code == 12
    assert (await kibo(operator, "storage-pool", "declare-lost", "pool-a")).exit_code == 2
    members = await kibo(operator, "storage-pool", "declare-lost", "pool-a",
                         "--confirm-data-lost", "--yes")
    assert members.exit_code == 13
    assert "still has member nodes: node-a (READY)" in members.stderr
    stale = await kibo(operator, "storage-pool", "set-capacity", "pool-a", "3G",
                       "--expected-version", str(pool["revision"] + 1))
    assert stale.exit_code == 14
    assert (await kibo_json(operator, "storage-pool", "get", "pool-a"))["capacity_bytes"] \
        == 2 * GI


def test_docs_name_every_storage_pool_command_and_option() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "storage.md").read_text()
    ctx = click.Context(pool_group)
    names = pool_group.list_commands(ctx)
    assert names == ["declare-lost", "get", "list", "objects", "set-capacity"]
    for name in names:
        cmd = pool_group.get_command(ctx, name)
        assert cmd is not None
        assert f"kibo storage-pool {name}" in doc, name
        for param in cmd.params:
            if isinstance(param, click.Option) and not param.hidden and param.name not in (
                    "config_path", "as_json", "timeout"):
                assert max(param.opts, key=len) in doc, (name, param.opts)
