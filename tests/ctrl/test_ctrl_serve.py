"""serve_ctrl and the ``kibotos ctrl`` commands: binding port 0 and reporting it, marking
the previous process's sessions dead, graceful shutdown on SIGTERM, and ``grant``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
from click.testing import CliRunner
from ctrl_helpers import (
    enroll_operator,
    exchange,
    make_config,
    read_node,
    result,
    update_node,
    wait_until,
)

from kibotos.cli.main import kibotos_cli
from kibotos.ctrl.api.app import build_app
from kibotos.ctrl.serve import (
    LISTEN_ADDRESS_FILE,
    build_context,
    build_services,
    open_store,
    serve_ctrl,
)
from kibotos.testing.fake_node import open_sim_node
from kibotos.tls.local_ctrl import client_tls, ctrl_url


async def test_serve_binds_port_zero_and_reports_it(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    async with trio.open_nursery() as nursery:
        address = await nursery.start(partial(serve_ctrl, config, handle_signals=False))
        host, _, port = address.rpartition(":")
        assert host == "127.0.0.1"
        assert int(port) > 0
        address_file = tmp_path / "state" / LISTEN_ADDRESS_FILE
        assert address_file.read_text() == address + "\n"
        url = ctrl_url(config, address)
        assert url.startswith("https://")  # TLS by default, from the cluster CA
        async with httpx.AsyncClient(base_url=url, verify=client_tls(config)) as http:
            assert result(await http.get("/v1/health"))["status"] == "ok"
            assert (await http.get("/v1/openapi.json")).json()["openapi"] == "3.1.0"
        assert (tmp_path / "state" / "ctrl.db").exists()
        nursery.cancel_scope.cancel()
    assert not address_file.exists()


async def test_sessions_of_the_previous_process_are_dead(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    store = await open_store(config)
    try:
        app = build_app(build_services(build_context(config, store)))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://ctrl") as http:
            operator = await enroll_operator(http, store)
            grant = result(await http.post("/v1/enrollment/grants", headers=operator,
                                           json={"kind": "node", "node_id": "node-a"}))
            await exchange(http, grant["token"])
        # What a killed ctrl leaves behind: a session marked alive.
        await update_node(store, "node-a", session_alive=True, session_id="ses-old",
                          incarnation=1)
    finally:
        store.close()
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve_ctrl, config, handle_signals=False))
        store = await open_store(config)
        try:
            node = await read_node(store, "node-a")
            assert node.session_alive is False
            assert node.session_ended_at is not None
            assert node.registration_version == 2
        finally:
            store.close()
        nursery.cancel_scope.cancel()


async def test_sigterm_closes_sessions_and_exits_cleanly(tmp_path: Path) -> None:
    config_path = tmp_path / "ctrl.toml"
    state = tmp_path / "state"
    config_path.write_text(f'[ctrl]\nlisten = "127.0.0.1:0"\nstate_dir = "{state}"\n')
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "kibotos.cli.main", "ctrl", "serve", "--config",
         str(config_path)], stderr=subprocess.DEVNULL)
    try:
        address_file = state / LISTEN_ADDRESS_FILE

        async def listening() -> bool:
            return address_file.exists()
        await wait_until(listening, "ctrl wrote its listen address", timeout=60)
        served = make_config(tmp_path)
        url = ctrl_url(served, address_file.read_text().strip())
        store = await open_store(served)
        try:
            async with httpx.AsyncClient(base_url=url, verify=client_tls(served)) as http:
                operator = await enroll_operator(http, store)
                grant = result(await http.post("/v1/enrollment/grants", headers=operator,
                                               json={"kind": "node", "node_id": "node-a"}))
                cred = (await exchange(http, grant["token"]))["credential"]
            async with open_sim_node(url, cred, "node-a", 1,
                                     ssl_context=client_tls(served)) as node:
                assert node.welcomed
                proc.send_signal(signal.SIGTERM)
                with trio.fail_after(30):
                    await node.closed.wait()
                assert node.close_reason == "ctrl_shutdown"
            with trio.fail_after(30):
                assert await proc.wait() == 0
            assert (await read_node(store, "node-a")).session_alive is False
        finally:
            store.close()
        assert not address_file.exists()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


# ------------------------------------------------------------------- kibotos ctrl grant


def _write_config(tmp_path: Path) -> Path:
    path = tmp_path / "ctrl.toml"
    path.write_text(f'[ctrl]\nstate_dir = "{tmp_path / "state"}"\n')
    return path


def test_grant_writes_the_store_and_prints_the_token(tmp_path: Path) -> None:
    config = _write_config(tmp_path)
    runner = CliRunner()
    out = runner.invoke(kibotos_cli, ["ctrl", "grant", "--config", str(config),
                                      "--kind", "operator", "--expires", "1h"],
                        catch_exceptions=False)
    assert out.exit_code == 0, out.output
    token = out.stdout.strip()
    assert token.startswith("kgr-")
    assert "expires" in out.stderr

    async def use() -> None:
        store = await open_store(make_config(tmp_path))
        try:
            app = build_app(build_services(build_context(make_config(tmp_path), store)))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://ctrl") as http:
                issued = await exchange(http, token)
                assert issued["kind"] == "operator"
        finally:
            store.close()

    trio.run(use)
    out = runner.invoke(kibotos_cli, ["ctrl", "grant", "--config", str(config), "--kind",
                                      "node", "--node-id", "node-a", "--json"],
                        catch_exceptions=False)
    assert out.exit_code == 0, out.output
    body = json.loads(out.stdout)["result"]
    assert body["kind"] == "node"
    assert body["node_id"] == "node-a"
    assert body["token"].startswith(body["grant_id"] + ".")


@pytest.mark.parametrize(("args", "code", "text"), [
    (["--kind", "node"], 10, "node_id is required"),
    (["--kind", "operator", "--node-id", "node-a"], 10, "must not be given"),
    (["--kind", "node", "--node-id", "Bad_Node"], 10, "invalid node ID"),
    (["--kind", "operator", "--expires", "soon"], 10, "--expires"),
    (["--kind", "operator", "--expires", "0s"], 10, "must be positive"),
])
def test_grant_bad_input(tmp_path: Path, args: list[str], code: int, text: str) -> None:
    config = _write_config(tmp_path)
    out = CliRunner().invoke(kibotos_cli, ["ctrl", "grant", "--config", str(config), *args])
    assert out.exit_code == code, out.output
    assert text in out.stderr
    assert out.stdout == ""


def test_bad_config_is_a_clear_error(tmp_path: Path) -> None:
    runner = CliRunner()
    for body, text in [("[ctrl]\nlisten = 'nowhere'\n", "listen"),
                       ("[ctrl]\nbogus = 1\n", "bogus"),
                       ("[ctrl\n", "not valid TOML")]:
        path = tmp_path / "ctrl.toml"
        path.write_text(body)
        for command in (["ctrl", "grant", "--kind", "operator"], ["ctrl", "serve"]):
            out = runner.invoke(kibotos_cli, [*command, "--config", str(path)])
            assert out.exit_code == 10, out.output
            assert text in out.stderr
            assert out.stderr.startswith("error: invalid_argument:")
    out = runner.invoke(kibotos_cli, ["ctrl", "serve", "--config",
                                      str(tmp_path / "missing.toml")])
    assert out.exit_code == 10
    assert "does not exist" in out.stderr
    assert not (tmp_path / "state").exists()


def test_grant_for_a_retired_node_exits_13(tmp_path: Path) -> None:
    config = _write_config(tmp_path)
    runner = CliRunner()

    async def retire() -> None:
        store = await open_store(make_config(tmp_path))
        try:
            app = build_app(build_services(build_context(make_config(tmp_path), store)))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://ctrl") as http:
                operator = await enroll_operator(http, store)
                grant = result(await http.post("/v1/enrollment/grants", headers=operator,
                                               json={"kind": "node", "node_id": "node-a"}))
                await exchange(http, grant["token"])
                await update_node(store, "node-a", drain_requested=True)
                result(await http.post("/v1/nodes/node-a/retire", headers=operator, json={}))
        finally:
            store.close()

    trio.run(retire)
    out = runner.invoke(kibotos_cli, ["ctrl", "grant", "--config", str(config), "--kind",
                                      "node", "--node-id", "node-a"])
    assert out.exit_code == 13
    assert "retired" in out.stderr


def test_kibotos_ctrl_is_on_the_path_as_a_console_script() -> None:
    exe = Path(sys.executable).with_name("kibotos")
    assert exe.exists()
    out = subprocess.run([str(exe), "ctrl", "--help"], capture_output=True, text=True,
                         check=False, timeout=60, env={**os.environ, "COLUMNS": "100"})
    assert out.returncode == 0
    assert "serve" in out.stdout
    assert "grant" in out.stdout


async def test_reconciliation_runs_every_interval(tmp_path: Path) -> None:
    config = make_config(tmp_path, reconcile_interval="0.3s")
    async with trio.open_nursery() as nursery:
        address = await nursery.start(partial(serve_ctrl, config, handle_signals=False))
        url = ctrl_url(config, address)
        store = await open_store(config)
        try:
            async with httpx.AsyncClient(base_url=url, verify=client_tls(config)) as http:
                operator = await enroll_operator(http, store)
                grant = result(await http.post("/v1/enrollment/grants", headers=operator,
                                               json={"kind": "node", "node_id": "node-a"}))
                cred = (await exchange(http, grant["token"]))["credential"]
                async with open_sim_node(url, cred, "node-a", 1,
                                         ssl_context=client_tls(config)) as node:
                    for _ in range(3):
                        before = len(node.received)
                        await node.wait_for("clock_probe", after=before)
                        await node.wait_for("usage_request", after=before)
                    seen: set[str] = set()

                    async def several_measurements() -> bool:
                        measured = await read_node(store, "node-a")
                        if measured.clock_measured_at is not None:
                            seen.add(str(measured.clock_measured_at))
                        return len(seen) >= 3
                    await wait_until(several_measurements, "three stored measurements")
        finally:
            store.close()
        nursery.cancel_scope.cancel()
