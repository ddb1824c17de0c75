"""The E2B gateway as a real process beside a dev cluster: its own operator identity
(a grant from the cluster's operator, exchanged), its config, ``kibotos gateway e2b
serve``, the bound addresses it writes, and a clean stop."""

from __future__ import annotations

import base64
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kibotos.dev import DevCluster
from kibotos.dev.procs import tail


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
    proc = cluster.kibo("api-key", "create", name, "--team", team)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@dataclass
class Gateway:
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
            raise AssertionError(f"the gateway did not start:\n{log.read_text()[-4000:]}")
        time.sleep(0.1)
    api, sandbox = (f"http://{f.read_text().strip()}" for f in files)
    return Gateway(process, directory, api, sandbox, log)


@dataclass
class E2bSetup:
    cluster: DevCluster
    gateway: Gateway
    key: str  # team blue
    other_key: str  # team red

    def opts(self, key: str | None = None) -> dict[str, str]:
        """The SDK's connection options for this gateway (what E2B_API_KEY,
        E2B_API_URL and E2B_SANDBOX_URL say in a user's environment)."""
        return {"api_key": key or self.key, "api_url": self.gateway.api_url,
                "sandbox_url": self.gateway.sandbox_url}


@contextmanager
def e2b_cluster(prefix: str, up: dict[str, Any], prepare: Callable[[DevCluster], None],
                templates: dict[str, str], **gateway: Any) -> Iterator[E2bSetup]:
    """A dev cluster (``DevCluster.up(**up)``, then `prepare`), a gateway in front of
    it and keys of teams blue and red; everything stopped (logs printed) on the way out.
    The directory is short: guest agent sockets must fit sun_path."""
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    cluster = DevCluster(base / "c", timeout=180)
    started = None
    try:
        cluster.up(**up)
        prepare(cluster)
        started = start_gateway(cluster, base / "gw", templates=templates, **gateway)
        yield E2bSetup(cluster, started, api_key(cluster, "blue-ci", "blue"),
                       api_key(cluster, "red-ci", "red"))
    finally:
        try:
            if started is not None:
                started.stop()
                print(f"----- {started.log} (last lines)\n{tail(started.log, 60)}")
            cluster.down(grace=10)
        finally:
            for svc in cluster.services():
                print(f"----- {svc.log} (last lines)\n{tail(svc.log, 40)}")
            shutil.rmtree(base, ignore_errors=True)
            for link in Path("/tmp").glob("kibotos-dev-*"):  # the cluster's short links
                if link.is_symlink() and Path(os.readlink(link)).is_relative_to(base):
                    link.unlink(missing_ok=True)
