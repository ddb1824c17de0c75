"""``kibotos dev cluster up --store postgresql --ctrl-replicas 2``: a PostgreSQL server
under DIR, two ctrl replicas, the nodes spread over them, DIR/kibo.toml listing both;
each node lists every replica, its own first; with the first replica SIGKILLed, `kibo`
goes on through the second, the node on the second keeps its session, and the node on
the first gets a new one on the second."""

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
    # Each node starts on its own replica and lists the other after it.
    assert node_urls == [[urls[0], urls[1]], [urls[1], urls[0]]]
    running = {s.name: s.pid for s in dev_cluster.status()}
    assert running["ctrl"] is not None
    assert running["ctrl-2"] is not None
    nodes = kibo_json(dev_cluster, "node", "list")["result"]["nodes"]
    assert {n["node_id"]: n["status"] for n in nodes} == {"node-1": "READY",
                                                          "node-2": "READY"}
    before = {n["node_id"]: n["latest_session"]["session_id"] for n in nodes}

    os.kill(running["ctrl"], signal.SIGKILL)

    def node_1_on_the_second() -> bool:
        listed = kibo_json(dev_cluster, "node", "list")["result"]["nodes"]
        by_id = {n["node_id"]: n for n in listed}
        # node-2's session on the live replica is never ended; node-1's ended with the
        # killed replica, and node-1 reconnects to the next replica it lists.
        assert by_id["node-2"]["status"] == "READY"
        assert by_id["node-2"]["latest_session"]["session_id"] == before["node-2"]
        node_1 = by_id["node-1"]
        return (node_1["status"] == "READY"
                and node_1["latest_session"]["session_id"] != before["node-1"])
    wait_until(node_1_on_the_second, "node-1 has a new session, on the second replica")
