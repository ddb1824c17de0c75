"""Fixtures of the E2B gateway tests: one dev cluster whose node runs the test VMM (the
real node path and guest agent, without QEMU), with the Template ``tiny``, one gateway
process in front of it, and two API keys of two teams; shared by every case (session
scope), and stopped at the end with every process it started."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from gateway_proc import Gateway, api_key, start_gateway

from kibotos.dev import DevCluster
from kibotos.dev.procs import tail

TESTPLUGINS = Path(__file__).parents[1] / "testplugins"
NODE_ENV = {"KIBOTOS_TEST_PLUGIN_MODULES": "kibotos_testvmm",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTPLUGINS),
                                                        os.environ.get("PYTHONPATH")]))}


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


def _upload_tiny(cluster: DevCluster) -> None:
    """Three blobs ctrl accepts; the test VMM does not read them."""
    blobs = {"image_digest": bytes(1080) + b"\x53\xef" + bytes(62),
             "kernel_digest": b"\x7fELF" + bytes(60), "initramfs_digest": b"initramfs"}
    body = {}
    for field, blob in blobs.items():
        hexd = hashlib.sha256(blob).hexdigest()
        cluster.api("PUT", f"/v1/artifacts/sha256/{hexd}", content=blob)
        body[field] = f"sha256:{hexd}"
    cluster.api("PUT", "/v1/templates/tiny", json=body)


@pytest.fixture(scope="session")
def e2b() -> Iterator[E2bSetup]:
    base = Path(tempfile.mkdtemp(prefix="kgw", dir="/tmp"))
    cluster = DevCluster(base / "c", timeout=120)
    gateway = None
    try:
        cluster.up(nodes=1, reconcile_interval="2s", session_timeout="5s", test_inputs=True,
                   vmm_backend="testvmm", node_env=NODE_ENV)
        _upload_tiny(cluster)
        gateway = start_gateway(cluster, base / "gw", templates={"base": "tiny"})
        yield E2bSetup(cluster, gateway, api_key(cluster, "blue-ci", "blue"),
                       api_key(cluster, "red-ci", "red"))
    finally:
        try:
            if gateway is not None:
                gateway.stop()
                print(f"----- {gateway.log} (last lines)\n{tail(gateway.log, 60)}")
            cluster.down(grace=10)
        finally:
            for svc in cluster.services():
                print(f"----- {svc.log} (last lines)\n{tail(svc.log, 40)}")
            shutil.rmtree(base, ignore_errors=True)
