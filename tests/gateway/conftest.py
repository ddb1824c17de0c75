"""Fixtures of the E2B gateway tests: one dev cluster whose node runs the test VMM (the
real node path and guest agent, without QEMU), with the Template ``tiny``, one gateway
process in front of it, and two API keys of two teams; shared by every case (session
scope), and stopped at the end with every process it started."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from gateway_proc import E2bSetup, e2b_cluster

from kibotos.dev import DevCluster

TESTPLUGINS = Path(__file__).parents[1] / "testplugins"
NODE_ENV = {"KIBOTOS_TEST_PLUGIN_MODULES": "kibotos_testvmm",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTPLUGINS),
                                                        os.environ.get("PYTHONPATH")]))}


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
    up = {"nodes": 1, "reconcile_interval": "2s", "session_timeout": "5s",
          "test_inputs": True, "vmm_backend": "testvmm", "node_env": NODE_ENV}
    with e2b_cluster("kgw", up, _upload_tiny, {"base": "tiny"}, memory_bytes=128 << 20,
                     layer_size_bytes=64 << 20) as setup:
        yield setup
