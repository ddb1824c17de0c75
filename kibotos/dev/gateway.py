"""An E2B gateway as a real process beside a dev cluster (tests, bench/gateway.py): its
own operator identity (a grant from the cluster's operator, exchanged), its config,
``kibotos gateway e2b serve``, the bound addresses it writes, API keys, a clean stop.

Like the rest of `kibotos.dev` it drives only public surfaces: ctrl's API, ``kibo`` and
the gateway's command line."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kibotos.dev.cluster import DevCluster


def _public_key() -> str:
    raw = Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def enroll_gateway(cluster: DevCluster, name: str = "e2b-gateway") -> str:
    """A fresh operator identity for the gateway; its bearer credential."""
    grant = cluster.api("POST", "/v1/enrollment/grants",
                        json={"kind": "operator", "name": name})
    issued = cluster.api("POST", "/v1/enrollment/exchange",
                         json={"token": grant["token"], "public_key": _public_key()})
    return str(issued["credential"])


def api_key(cluster: DevCluster, name: str, team: str) -> str:
    """A new API key of `team` (``kibo api-key create``)."""
    proc = cluster.kibo("api-key", "create", name, "--team", team)
    if proc.returncode != 0:
        raise RuntimeError(f"kibo api-key create failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


@dataclass
class Gateway:
    """A started gateway: its process, directory, URLs (E2B_API_URL, E2B_SANDBOX_URL)."""

    process: subprocess.Popen[bytes]
    directory: Path
    api_url: str
    sandbox_url: str
    log: Path

    def stop(self, grace: float = 10.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=grace)
        return self.process.returncode


def start_gateway(cluster: DevCluster, directory: Path, *, templates: dict[str, str],
                  default_timeout_s: int = 300, memory_bytes: int = 128 << 20,
                  layer_size_bytes: int = 64 << 20, timeout: float = 60.0) -> Gateway:
    """Enroll, configure and start a gateway under `directory`; return once it listens.
    `templates` are its aliases (E2B template ID -> Template); the sizes are every
    sandbox's Workspace resources."""
    directory.mkdir(parents=True, exist_ok=True)
    credential = directory / "credential"
    credential.write_text(enroll_gateway(cluster) + "\n")
    credential.chmod(0o600)
    aliases = "".join(f'{k} = "{v}"\n' for k, v in templates.items())
    config = directory / "gateway.toml"
    config.write_text(
        'listen = "127.0.0.1:0"\nsandbox_listen = "127.0.0.1:0"\n'
        f'state_dir = "{directory / "state"}"\n'
        f'[ctrl]\nurl = "{cluster.ctrl_url}"\ncredential_file = "{credential}"\n'
        f"[templates]\n{aliases}"
        f"[sandbox]\ndefault_timeout_s = {default_timeout_s}\ncpu_millis = 500\n"
        f"memory_bytes = {memory_bytes}\nlayer_size_bytes = {layer_size_bytes}\n")
    log = directory / "gateway.log"
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "kibotos.cli.main", "gateway", "e2b", "serve",
             "--config", str(config)], stdout=out, stderr=out, stdin=subprocess.DEVNULL,
            env={**os.environ})
    files = [directory / "state" / "listen-address",
             directory / "state" / "sandbox-listen-address"]
    deadline = time.monotonic() + timeout
    while not all(f.exists() for f in files):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise RuntimeError(f"the gateway did not start:\n{log.read_text()[-4000:]}")
        time.sleep(0.1)
    api, sandbox = (f"http://{f.read_text().strip()}" for f in files)
    return Gateway(process, directory, api, sandbox, log)

