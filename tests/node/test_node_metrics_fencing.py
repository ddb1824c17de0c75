"""The node's fencing counter follows the Instance manager's feed: a FAILED frame whose
reason says the use right was taken over counts once per Instance (the holder check may
send two: VMM not stopped yet, then fenced), other failures do not count; the text is
served over HTTP on loopback and parses with prometheus-client's parser."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import httpx
import trio
from node_helpers import write_proc
from prometheus_client.parser import text_string_to_metric_families

from kibotos.node.host.usage import UsageSampler
from kibotos.node.instances.contract import EmptyInstanceManager
from kibotos.node.metrics import NodeMetrics, NodeParts, serve_metrics
from kibotos.node.session.control import SessionStatus
from kibotos.node.storage.holder_watch import TAKEN_OVER


def fencings(text: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kibotos_node_fencings_total":
                return float(s.value)
    raise AssertionError("no kibotos_node_fencings_total in the text")


async def test_fencings_counted_once_per_instance(tmp_path: Path) -> None:
    manager = EmptyInstanceManager()
    sampler = UsageSampler(write_proc(tmp_path / "proc"))
    sampler.sample()
    metrics = NodeMetrics(NodeParts(manager, sampler, SessionStatus(), lambda: []))
    feed = manager.state_feed()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(partial(serve_metrics, metrics, "127.0.0.1:0",
                                                  tmp_path))
            assert (tmp_path / "metrics-address").read_text().strip() == address
            async with httpx.AsyncClient(base_url=f"http://{address}") as http:
                assert fencings((await http.get("/metrics")).text) == 0
                frame = {"type": "instance_state", "workspace_id": "ws-1", "state": "FAILED"}
                feed.publish({**frame, "instance_id": "inst-1",
                              "reason": f"{TAKEN_OVER}, but its VMM did not stop yet: x"})
                feed.publish({**frame, "instance_id": "inst-1",
                              "reason": f"{TAKEN_OVER}: volume vol-1 is held by node b"})
                feed.publish({**frame, "instance_id": "inst-2", "reason": "oom_killed"})
                feed.publish({**frame, "instance_id": "inst-3", "state": "RUNNING",
                              "reason": None})
                while fencings((await http.get("/metrics")).text) < 1:
                    await trio.sleep(0.05)
                feed.publish({**frame, "instance_id": "inst-4",
                              "reason": f"{TAKEN_OVER}: layer lay-1 is held by node c"})
                while (got := fencings((await http.get("/metrics")).text)) < 2:
                    await trio.sleep(0.05)
                assert got == 2
                text = (await http.get("/metrics")).text
                assert "kibotos_node_memory_tight 0.0" in text
                assert (await http.get("/nothing")).status_code == 404
            nursery.cancel_scope.cancel()
    assert not (tmp_path / "metrics-address").exists()
