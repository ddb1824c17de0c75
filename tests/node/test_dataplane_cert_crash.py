"""A real node process killed right after saving the data-plane certificate ctrl issued
(failpoint ``node.dataplane-cert.after-save``), before its data plane had it: the data
plane still has none, and the restarted node supplies the saved one without asking ctrl
again (it is not due), so new handshakes get it."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import BinaryIO

import pytest
import trio
from cryptography import x509
from node_helpers import ctrl_endpoint, free_port, write_config
from test_node_metrics import KIBOTOS, grant

from kibotos.config import CtrlConfig, load
from kibotos.core.failpoints import ENV
from kibotos.ctrl.serve import serve_ctrl
from kibotos.dataplane.process.control import control_call, control_path
from kibotos.node.dataplane.certificate import CERT_FILE

pytestmark = pytest.mark.slow


def log_file(path: Path) -> BinaryIO:
    """Where a node process's log goes (the child keeps its own descriptor)."""
    return path.open("wb")


async def served_serial(control: Path) -> str | None:
    try:
        status = await control_call(control, {"type": "status"}, timeout=5)
    except Exception:
        return None  # not started yet
    serial = status.get("certificate_serial")
    return serial if isinstance(serial, str) else None


async def test_killed_after_saving_the_certificate_the_node_supplies_it_on_restart(
        tmp_path: Path) -> None:
    ctrl_toml = tmp_path / "ctrl.toml"
    ctrl_toml.write_text(f"""
[ctrl]
listen = "127.0.0.1:{free_port()}"
state_dir = "{tmp_path / 'ctrl'}"
""")
    grant_file = tmp_path / "grant"
    ctrl = ctrl_endpoint(ctrl_toml)
    listen = f"127.0.0.1:{free_port()}"
    toml = write_config(tmp_path, ctrl_url=ctrl.url, ctrl_ca_file=ctrl.ca_file,
                        grant_file=grant_file)
    toml.write_text(toml.read_text().replace('dataplane_listen = "127.0.0.1:7500"',
                                             f'dataplane_listen = "{listen}"'))
    saved = tmp_path / "root" / "state" / CERT_FILE
    control = control_path(tmp_path / "run")
    argv = [*KIBOTOS, "node", "serve", "--config", str(toml)]
    logs = [tmp_path / "node-1.log", tmp_path / "node-2.log"]

    with trio.fail_after(180):
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: serve_ctrl(
                load(CtrlConfig, ctrl_toml), handle_signals=False, task_status=task_status))
            grant_file.write_text(await grant(ctrl_toml) + "\n")
            with log_file(logs[0]) as log:
                node = await trio.lowlevel.open_process(
                    argv, stderr=log, stdout=subprocess.DEVNULL,
                    env={**os.environ, ENV: "node.dataplane-cert.after-save=kill"})
            try:
                assert await node.wait() == -signal.SIGKILL, logs[0].read_text()
                serial = f"{x509.load_pem_x509_certificate(saved.read_bytes()).serial_number:x}"
                assert await served_serial(control) is None
                with log_file(logs[1]) as log:
                    node = await trio.lowlevel.open_process(argv, stderr=log,
                                                            stdout=subprocess.DEVNULL)
                while await served_serial(control) != serial:
                    assert node.returncode is None, logs[1].read_text()
                    await trio.sleep(0.2)
                host, _, port = listen.rpartition(":")
                stream = await trio.open_ssl_over_tcp_stream(host, int(port),
                                                             ssl_context=ctrl.tls)
                await stream.do_handshake()
                der = stream.getpeercert(binary_form=True)
                await trio.aclose_forcefully(stream)
                assert der is not None
                assert f"{x509.load_der_x509_certificate(der).serial_number:x}" == serial
                assert "data-plane certificate obtained" not in logs[1].read_text()
            finally:
                if node.returncode is None:
                    node.send_signal(signal.SIGTERM)
                    await node.wait()
                # `kibotos node serve` started its data plane, which outlives the node.
                await trio.run_process([*KIBOTOS, "dataplane", "stop", "--config", str(toml)],
                                       capture_stdout=True, check=False)
            nursery.cancel_scope.cancel()
