"""The gateways of a dev cluster: ``DIR/gateway-e2b/`` and ``DIR/gateway-exposure/``
each hold a config, the gateway's own operator credential (a grant from the cluster's
operator, exchanged), its state, log and PID file; each runs as one more supervised
process (``e2b-gateway``, ``exposure-gateway``), stopped first by ``down``.  Both
serve sandboxes under the domain `DOMAIN`.  Once they listen, an API key of team
``default`` is created and ``DIR/e2b.env`` (mode 0600) written, so ``set -a; .
DIR/e2b.env`` is all an SDK script needs; ``KIBOTOS_EXPOSURE_URL`` in it is the
Exposure gateway's loopback address, which routes by the ``Host`` header (send
``Host: <sandbox.get_host(port)>``; curl and browsers resolve ``*.localhost``
themselves, so ``http://<get_host(port)>:<its port>/`` works as it is).

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

from kibotos.core import atomicfile
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

NAME, EXPOSURE_NAME = "e2b-gateway", "exposure-gateway"
#: E2B's default template, as the demo's Template.
DEFAULT_TEMPLATES = {"base": "kibotos-base"}
#: The sandboxes' domain (E2B_DOMAIN): ``<port>-<id>.kibotos.localhost``, a name that
#: is loopback by RFC 6761, so nothing outside the machine is ever asked for it.
DOMAIN = "kibotos.localhost"


@dataclass(frozen=True)
class GatewayUrls:
    api_url: str  # E2B_API_URL
    sandbox_url: str  # E2B_SANDBOX_URL
    api_key: str  # E2B_API_KEY (team default)
    env_file: Path
    exposure_url: str | None = None  # KIBOTOS_EXPOSURE_URL
    domain: str = DOMAIN  # E2B_DOMAIN


def directory(cluster_dir: Path) -> Path:
    return cluster_dir / "gateway-e2b"


def exposure_directory(cluster_dir: Path) -> Path:
    return cluster_dir / "gateway-exposure"


def service(cluster_dir: Path, kibotos_script: str) -> Service:
    d = directory(cluster_dir)
    config = d / "gateway.toml"
    return Service(NAME, (kibotos_script, "gateway", "e2b", "serve", "--config", str(config)),
                   config, d / "gateway.log", d / "gateway.pid")


def exposure_service(cluster_dir: Path, kibotos_script: str) -> Service:
    d = exposure_directory(cluster_dir)
    config = d / "gateway.toml"
    return Service(EXPOSURE_NAME, (kibotos_script, "gateway", "exposure", "serve",
                                   "--config", str(config)),
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


def _ctrl_section(cluster: DevCluster, d: Path, name: str) -> str:
    """The ``[ctrl]`` section of a gateway in `d`, with a fresh identity `name`."""
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    credential = d / "credential"
    atomicfile.write_bytes(credential, (enroll(cluster, name) + "\n").encode(), mode=0o600)
    return (f'[ctrl]\nurl = "{cluster.ctrl_url}"\ncredential_file = "{credential}"\n'
            + (f'ca_file = "{ca}"\n' if (ca := cluster.ctrl_ca_file()) else ""))


def write_config(cluster: DevCluster, *, templates: dict[str, str], default_timeout_s: int,
                 memory_bytes: int, layer_size_bytes: int) -> None:
    d = directory(cluster.dir)
    ctrl = _ctrl_section(cluster, d, NAME)
    aliases = "".join(f'{k} = "{v}"\n' for k, v in templates.items())
    text = ('# Written by kibotos dev cluster (docs/gateways.md).\n'
            'listen = "127.0.0.1:0"\nsandbox_listen = "127.0.0.1:0"\n'
            f'state_dir = "{d / "state"}"\ndomain = "{DOMAIN}"\n{ctrl}'
            f"[templates]\n{aliases}"
            f"[sandbox]\ndefault_timeout_s = {default_timeout_s}\ncpu_millis = 500\n"
            f"memory_bytes = {memory_bytes}\nlayer_size_bytes = {layer_size_bytes}\n")
    atomicfile.write_bytes(d / "gateway.toml", text.encode(), mode=0o600)
    for stale in ("listen-address", "sandbox-listen-address"):
        (d / "state" / stale).unlink(missing_ok=True)


def write_exposure_config(cluster: DevCluster) -> None:
    d = exposure_directory(cluster.dir)
    ctrl = _ctrl_section(cluster, d, EXPOSURE_NAME)
    text = ('# Written by kibotos dev cluster (docs/gateways.md).\n'
            'listen = "127.0.0.1:0"\nmetrics_listen = "127.0.0.1:0"\n'
            f'state_dir = "{d / "state"}"\ndomain = "{DOMAIN}"\n{ctrl}')
    atomicfile.write_bytes(d / "gateway.toml", text.encode(), mode=0o600)
    for stale in ("listen-address", "metrics-listen-address"):
        (d / "state" / stale).unlink(missing_ok=True)


def wait_listening(cluster_dir: Path, exited: Callable[[], int | None],
                   deadline: float, *, exposure: bool = False) -> tuple[str, str]:
    """The gateway's two URLs (E2B: API and sandboxes; Exposure: proxy and metrics)
    once it wrote them; an error with its log if it exits."""
    d = exposure_directory(cluster_dir) if exposure else directory(cluster_dir)
    second = "metrics-listen-address" if exposure else "sandbox-listen-address"
    files = [d / "state" / "listen-address", d / "state" / second]
    while not all(f.exists() for f in files):
        status = exited()
        if status is not None or time.monotonic() > deadline:
            log = d / "gateway.log"
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            why = f"exited with status {status}" if status is not None else "is not listening"
            which = "Exposure" if exposure else "E2B"
            raise RuntimeError(f"the {which} gateway {why}; {log}:\n{tail}")
        time.sleep(0.1)
    first, then = (f"http://{f.read_text().strip()}" for f in files)
    return first, then


def write_env(cluster_dir: Path, urls: GatewayUrls) -> Path:
    """``DIR/e2b.env``: what the E2B SDKs read (it holds a key: mode 0600)."""
    path = cluster_dir / "e2b.env"
    text = (f"E2B_API_URL={urls.api_url}\nE2B_SANDBOX_URL={urls.sandbox_url}\n"
            f"E2B_API_KEY={urls.api_key}\nE2B_DOMAIN={urls.domain}\n"
            + (f"KIBOTOS_EXPOSURE_URL={urls.exposure_url}\n" if urls.exposure_url else ""))
    atomicfile.write_bytes(path, text.encode(), mode=0o600)
    return path
