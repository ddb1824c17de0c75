"""``kibotos dev cluster up --store postgresql --ctrl-replicas 2``: a PostgreSQL server
under DIR, two ctrl replicas, the nodes spread over them, DIR/kibo.toml listing both;
with the first replica SIGKILLed, `kibo` goes on through the second, and the node on
the second keeps its session."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import pytest

from kibotos import config
from kibotos.cli.core import kibo_config
from kibotos.dev import DevCluster

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


@pytest.mark.cluster(nodes=2, store="postgresql", ctrl_replicas=2)
def test_two_ctrl_replicas_on_postgresql(dev_cluster: DevCluster,
                                         kibo_json: Callable[..., Any],
                                         wait_until: Callable[..., Any]) -> None:
    urls = kibo_config.load(dev_cluster.layout.kibo_config).ctrl_urls
    assert len(urls) == 2
    node_urls = [config.load(config.NodeConfig, dev_cluster.layout.node_config(n)).node.ctrl_url
                 for n in ("node-1", "node-2")]
    assert node_urls == list(urls)  # one node per replica
    running = {s.name: s.pid for s in dev_cluster.status()}
    assert running["ctrl"] is not None
    assert running["ctrl-2"] is not None
    nodes = kibo_json(dev_cluster, "node", "list")["result"]["nodes"]
    assert {n["node_id"]: n["status"] for n in nodes} == {"node-1": "READY",
                                                          "node-2": "READY"}

    os.kill(running["ctrl"], signal.SIGKILL)

    def node_1_offline() -> bool:
        listed = kibo_json(dev_cluster, "node", "list")["result"]["nodes"]
        status = {n["node_id"]: n["status"] for n in listed}
        # node-2's session on the live replica is never ended; node-1 knows only the
        # dead replica's address (no load balancer in a dev cluster), so its session
        # is ended once the dead replica is declared gone.
        assert status["node-2"] == "READY"
        return status["node-1"] == "OFFLINE"
    wait_until(node_1_offline, "node-1's session (on the killed replica) ended")
