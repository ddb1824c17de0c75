"""The E2B gateway of a dev cluster: ``DIR/gateway-e2b/`` holds its config, its own
operator credential (a grant from the cluster's operator, exchanged), its state, log
and PID file; it runs as one more supervised process (``e2b-gateway``), stopped first
by ``down``.  Once it listens, an API key of team ``default`` is created and
``DIR/e2b.env`` (mode 0600) written, so ``set -a; . DIR/e2b.env`` is all an SDK
script needs.

Like the rest of `kibotos.dev` it drives only public surfaces: ctrl's API, ``kibo`` and
the gateway's command line."""

from __future__ import annotations

import base64
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kibotos import atomicfile
from kibotos.dev.procs import Service


class DevCluster(Protocol):
    """What this module uses of `kibotos.dev.cluster.DevCluster` (which uses this
    module: a protocol, not an import, keeps the two out of a cycle)."""

    @property
    def dir(self) -> Path: ...

    @property
    def ctrl_url(self) -> str: ...

    def ctrl_ca_file(self) -> Path | None: ...

    def api(self, method: str, path: str, **kwargs: Any) -> Any: ...

    def kibo(self, *args: str) -> subprocess.CompletedProcess[str]: ...

NAME = "e2b-gateway"
#: E2B's default template, as the demo's Template.
DEFAULT_TEMPLATES = {"base": "kibotos-base"}


@dataclass(frozen=True)
class GatewayUrls:
    api_url: str  # E2B_API_URL
    sandbox_url: str  # E2B_SANDBOX_URL
    api_key: str  # E2B_API_KEY (team default)
    env_file: Path


def directory(cluster_dir: Path) -> Path:
    return cluster_dir / "gateway-e2b"


def service(cluster_dir: Path, kibotos_script: str) -> Service:
    d = directory(cluster_dir)
    config = d / "gateway.toml"
    return Service(NAME, (kibotos_script, "gateway", "e2b", "serve", "--config", str(config)),
                   config, d / "gateway.log", d / "gateway.pid")


def _public_key() -> str:
    raw = Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def enroll(cluster: DevCluster, name: str = NAME) -> str:
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


def write_config(cluster: DevCluster, *, templates: dict[str, str], default_timeout_s: int,
                 memory_bytes: int, layer_size_bytes: int) -> None:
    d = directory(cluster.dir)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    credential = d / "credential"
    atomicfile.write_bytes(credential, (enroll(cluster) + "\n").encode(), mode=0o600)
    aliases = "".join(f'{k} = "{v}"\n' for k, v in templates.items())
    text = ('# Written by kibotos dev cluster (docs/gateways.md).\n'
            'listen = "127.0.0.1:0"\nsandbox_listen = "127.0.0.1:0"\n'
            f'state_dir = "{d / "state"}"\n'
            f'[ctrl]\nurl = "{cluster.ctrl_url}"\ncredential_file = "{credential}"\n'
            + (f'ca_file = "{ca}"\n' if (ca := cluster.ctrl_ca_file()) else "") +
            f"[templates]\n{aliases}"
            f"[sandbox]\ndefault_timeout_s = {default_timeout_s}\ncpu_millis = 500\n"
            f"memory_bytes = {memory_bytes}\nlayer_size_bytes = {layer_size_bytes}\n")
    atomicfile.write_bytes(d / "gateway.toml", text.encode(), mode=0o600)
    for stale in ("listen-address", "sandbox-listen-address"):
        (d / "state" / stale).unlink(missing_ok=True)


def wait_listening(cluster_dir: Path, exited: Callable[[], int | None],
                   deadline: float) -> tuple[str, str]:
    """The two URLs once the gateway wrote them; an error with its log if it exits."""
    state = directory(cluster_dir) / "state"
    files = [state / "listen-address", state / "sandbox-listen-address"]
    while not all(f.exists() for f in files):
        status = exited()
        if status is not None or time.monotonic() > deadline:
            log = directory(cluster_dir) / "gateway.log"
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            why = f"exited with status {status}" if status is not None else "is not listening"
            raise RuntimeError(f"the E2B gateway {why}; {log}:\n{tail}")
        time.sleep(0.1)
    api, sandbox = (f"http://{f.read_text().strip()}" for f in files)
    return api, sandbox


def write_env(cluster_dir: Path, api_url: str, sandbox_url: str, key: str) -> Path:
    """``DIR/e2b.env``: what the E2B SDKs read (it holds a key: mode 0600)."""
    path = cluster_dir / "e2b.env"
    text = (f"E2B_API_URL={api_url}\nE2B_SANDBOX_URL={sandbox_url}\nE2B_API_KEY={key}\n")
    atomicfile.write_bytes(path, text.encode(), mode=0o600)
    return path
