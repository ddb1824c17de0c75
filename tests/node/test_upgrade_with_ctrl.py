"""The upgrade path with Workspaces, a real ctrl and a real node on loopback (``testvmm``
VMMs): Workspaces run on a node that reports release N; the checks run before and after
its stop; the node is replaced by one reporting N+1 and ctrl sees the new release with
every Workspace still AVAILABLE on the same Instance.  A Workspace whose installation
was damaged in the window is FAILED with the spec's error and its VMM left running;
``stop --force`` reclaims it (spec troubleshooting) and a start runs it on N+1's runtime.
"""

from __future__ import annotations

import json
import os
import shutil
from functools import partial
from typing import Any

import httpx
import pytest
import trio
from ctrl_api_harness import Api, ctrl_grant, operator_headers, upload_template
from instance_harness import registries, short_dir, stop_all_units
from node_helpers import ctrl_endpoint, free_port, node_config

from kibotos.config import CtrlConfig, NodeConfig, load
from kibotos.ctrl.serve import serve_ctrl
from kibotos.node.checks import maintenance_check, upgrade_check
from kibotos.node.runtime import installations
from kibotos.node.runtime.build_identity import BuildIdentity
from kibotos.node.serve import serve_node
from kibotos.node.session.control import SessionTiming
from kibotos.plugins import EXTRA_MODULES_ENV

pytestmark = pytest.mark.slow

TIMING = SessionTiming(backoff_initial=0.05, backoff_cap=0.5)
EARLIER = BuildIdentity(release="0.4.1")
N = BuildIdentity(release="0.4.2")
N1 = BuildIdentity(release="0.5.0")
RUNTIME = installations.default_runtime_dir()


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def _launch(config: NodeConfig, instance_id: str) -> dict[str, Any]:
    path = config.storage.root / "runtime" / "instances" / instance_id / "systemd.json"
    return json.loads(path.read_text())  # type: ignore[no-any-return]


async def test_workspaces_survive_the_replacement_by_n_plus_1(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EXTRA_MODULES_ENV, "kibotos_testvmm")
    base = short_dir("ku-")
    port = free_port()
    ctrl_toml = base / "ctrl.toml"
    ctrl_toml.write_text(f'[ctrl]\nlisten = "127.0.0.1:{port}"\n'
                         f'state_dir = "{base / "ctrl"}"\nreconcile_interval = "0.5s"\n')
    ctrl = ctrl_endpoint(ctrl_toml)
    config = None
    try:
        with trio.fail_after(300):
            async with trio.open_nursery() as nursery:
                await nursery.start(partial(serve_ctrl, load(CtrlConfig, ctrl_toml),
                                            handle_signals=False))
                grant = base / "grant"
                grant.write_text(await ctrl_grant(ctrl_toml, "--kind", "node", "--node-id",
                                              "node-a"))
                config = node_config(base, ctrl_url=ctrl.url, ctrl_ca_file=ctrl.ca_file,
                                     grant_file=grant, extra='[vmm]\nbackend = "testvmm"\n')
                cfg = config

                class Running:
                    """One node process's life: `stop` cancels it and waits for its end
                    (the owner lock released), as a stopped service."""

                    def __init__(self) -> None:
                        self.scope = trio.CancelScope()
                        self.done = trio.Event()

                    async def stop(self) -> None:
                        self.scope.cancel()
                        await self.done.wait()

                async def node_as(build: BuildIdentity) -> Running:
                    running = Running()

                    async def run(task_status: Any) -> None:
                        try:
                            with running.scope:
                                await serve_node(cfg, sample_interval=0.05, timing=TIMING,
                                                 build=build, task_status=task_status)
                        finally:
                            running.done.set()

                    await nursery.start(run)
                    return running

                node = await node_as(EARLIER)
                async with httpx.AsyncClient(base_url=ctrl.url, verify=ctrl.tls,
                                             timeout=60) as http:
                    api = Api(http, await operator_headers(http, ctrl_toml))
                    await upload_template(api)
                    await api.until("/v1/nodes/node-a", lambda n: n["placement"]["eligible"])
                    await api.until("/v1/storage-pools/pool-a", lambda p: p is not None)
                    await api("POST", "/v1/storage-pools/pool-a/set-capacity",
                              json={"capacity_bytes": 4 << 30})
                    ws: dict[str, str] = {}
                    inst: dict[str, str] = {}

                    async def workspace(name: str) -> None:
                        created = await api.create({
                            "template": "tiny", "cpu_millis": 500, "memory_bytes": 128 << 20,
                            "layer_size_bytes": 64 << 20, "labels": {"name": name}})
                        ws[name] = created["workspace_id"]
                        got = await api.until(f"/v1/workspaces/{ws[name]}",
                                              lambda w: w["state"] != "CREATING")
                        assert got["state"] == "AVAILABLE", got
                        inst[name] = got["instance"]["instance_id"]

                    # 'damaged' starts on 0.4.1, 'keep' on N = 0.4.2 (which adopts it)
                    await workspace("damaged")
                    await node.stop()
                    node = await node_as(N)
                    await api.until("/v1/nodes/node-a", lambda n: n["latest_session"][
                        "release_version"] == "0.4.2" and n["placement"]["eligible"])
                    await workspace("keep")

                    preview = await upgrade_check.run(cfg, RUNTIME, preview=True, build=N1,
                                                      registries=registries())
                    assert preview.exit_code == 0, preview.render()
                    await node.stop()  # the node service stops; the VMMs run on
                    await api.until("/v1/nodes/node-a",
                                    lambda n: not n["latest_session"]["alive"])
                    window = await maintenance_check.run(cfg, "upgrade",
                                                         registries=registries())
                    assert window.exit_code == 0, window.render()
                    pinned = _launch(cfg, inst["damaged"])["installation"]
                    assert pinned["runtime_version"] == "0.4.1"
                    assert _launch(cfg, inst["keep"])["installation"]["runtime_version"] == \
                        "0.4.2"
                    earlier = installations.read(cfg.storage.root, pinned["identity"])
                    (earlier.path / "kibotos" / "guest" / "agent.py").write_text("# damaged\n")
                    full = await upgrade_check.run(cfg, RUNTIME, build=N1,
                                                   registries=registries())
                    blocked = full.of("blocked")
                    assert len(blocked) == 1, full.render()
                    assert blocked[0].startswith(f"instance {inst['damaged']}: runtime "
                                                 f"installation {earlier.identity} cannot be "
                                                 "kept")

                    node = await node_as(N1)
                    await api.until(
                        "/v1/nodes/node-a",
                        lambda n: n["latest_session"]["release_version"] == "0.5.0"
                        and n["latest_session"]["alive"])
                    damaged = await api.until(f"/v1/workspaces/{ws['damaged']}",
                                              lambda w: w["state"] == "FAILED")
                    assert "compatible runtime installation unavailable" in \
                        json.dumps(damaged), damaged
                    kept = await api("GET", f"/v1/workspaces/{ws['keep']}")
                    assert kept["state"] == "AVAILABLE", kept
                    assert kept["instance"]["instance_id"] == inst["keep"]
                    pid = _launch(cfg, inst["damaged"])["unit"]["main_pid"]
                    assert _alive(pid)  # the VMM was left running

                    # troubleshooting: reclaim, then start on N+1's runtime
                    await api("POST", f"/v1/workspaces/{ws['damaged']}/stop",
                              json={"force": True})
                    await api.until(f"/v1/workspaces/{ws['damaged']}",
                                    lambda w: w["state"] == "STOPPED")
                    await api("POST", f"/v1/workspaces/{ws['damaged']}/start", json={})
                    again = await api.until(f"/v1/workspaces/{ws['damaged']}",
                                            lambda w: w["state"] not in ("STARTING",))
                    assert again["state"] == "AVAILABLE", again
                    new = _launch(cfg, again["instance"]["instance_id"])["installation"]
                    assert new["runtime_version"] == "0.5.0"
                nursery.cancel_scope.cancel()
    finally:
        if config is not None:
            with trio.CancelScope(shield=True):
                await stop_all_units(config)
        shutil.rmtree(base, ignore_errors=True)
