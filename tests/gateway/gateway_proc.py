"""The E2B gateway tests' cluster: a dev cluster with its E2B gateway
(`DevCluster.start_e2b_gateway`) and API keys of two teams."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kibotos.dev import DevCluster
from kibotos.dev.gateway import GatewayUrls, api_key
from kibotos.dev.procs import tail


@dataclass
class E2bSetup:
    cluster: DevCluster
    gateway: GatewayUrls
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
    """A dev cluster (``DevCluster.up(**up)``, then `prepare`), its gateway and keys of
    teams blue and red; everything stopped (logs printed) on the way out.  The
    directory is short: guest agent sockets must fit sun_path."""
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    cluster = DevCluster(base / "c", timeout=180)
    try:
        cluster.up(**up)
        prepare(cluster)
        urls = cluster.start_e2b_gateway(templates=templates, **gateway)
        yield E2bSetup(cluster, urls, api_key(cluster, "blue-ci", "blue"),
                       api_key(cluster, "red-ci", "red"))
    finally:
        try:
            cluster.down(grace=10)
        finally:
            for svc in cluster.services():
                print(f"----- {svc.log} (last lines)\n{tail(svc.log, 40)}")
            shutil.rmtree(base, ignore_errors=True)
            for link in Path("/tmp").glob("kibotos-dev-*"):  # the cluster's short links
                if link.is_symlink() and Path(os.readlink(link)).is_relative_to(base):
                    link.unlink(missing_ok=True)
