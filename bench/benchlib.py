"""What the benchmarks share: starting a ctrl process, enrolling through the API, and
percentiles.  Everything goes through ctrl's real HTTP API, as `kibo` and nodes do."""

from __future__ import annotations

import base64
import json
import ssl
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from kibotos.config import CtrlConfig, load
from kibotos.tls import local_ctrl


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def new_public_key() -> str:
    """A fresh Ed25519 public key, base64, as an exchange takes it."""
    raw = Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw,
                                                                 PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def spawn_ctrl(workdir: Path, config_text: str,
               argv: Sequence[str]) -> tuple[subprocess.Popen[bytes], str, Path]:
    """Write `config_text` to ``workdir/ctrl.toml``, start `argv` (which must serve that
    config) in its own session with its output in ``ctrl.log``, and wait for the address
    it bound; returns the process, its URL and the config path."""
    config = workdir / "ctrl.toml"
    config.write_text(config_text)
    log = open(workdir / "ctrl.log", "wb")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen([*argv, "--config", str(config)], stdout=log, stderr=log,
                            start_new_session=True)
    address_file = workdir / "state" / "listen-address"
    deadline = time.monotonic() + 60
    while not address_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"ctrl did not start; see {workdir / 'ctrl.log'}")
        time.sleep(0.05)
    url = local_ctrl.ctrl_url(load(CtrlConfig, config), address_file.read_text().strip())
    return proc, url, config


def ctrl_tls(config: Path) -> ssl.SSLContext:
    """Verifies the ctrl of `config` (its cluster CA; https unless ``[tls] enabled =
    false``)."""
    return local_ctrl.client_tls(load(CtrlConfig, config))


def operator_credential(config: Path, url: str) -> str:
    """An operator identity: a grant written by ``kibotos ctrl grant``, exchanged."""
    exe = Path(sys.executable).with_name("kibotos")
    out = subprocess.run([str(exe), "ctrl", "grant", "--config", str(config), "--kind",
                          "operator", "--json"], check=True, capture_output=True, text=True)
    token = json.loads(out.stdout)["result"]["token"]
    resp = httpx.post(f"{url}/v1/enrollment/exchange", verify=ctrl_tls(config),
                      json={"token": token, "public_key": new_public_key()})
    resp.raise_for_status()
    return str(resp.json()["result"]["credential"])


async def enroll_node(http: httpx.AsyncClient, node_id: str) -> str:
    """A node grant from the operator client `http`, exchanged; the node's credential."""
    grant = await http.post("/v1/enrollment/grants", json={"kind": "node", "node_id": node_id})
    grant.raise_for_status()
    ex = await http.post("/v1/enrollment/exchange", json={
        "token": grant.json()["result"]["token"], "public_key": new_public_key()})
    ex.raise_for_status()
    return str(ex.json()["result"]["credential"])
