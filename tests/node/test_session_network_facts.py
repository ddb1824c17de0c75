"""The node says in ``hello``/``report`` whether it gives Instances a network and public
egress (``facts.network``, from ``[network]``); without the section it says nothing, as
nodes did before networking."""

from __future__ import annotations

from pathlib import Path

from node_helpers import RecordingInstances, store_identity, write_config

from kibotos.config import NodeConfig, load
from kibotos.node.host.clock import NodeClock
from kibotos.node.host.usage import UsageSampler
from kibotos.node.session.control import ControlSession
from kibotos.node.session.report import ReportBoard
from kibotos.protocol import Hello

NETWORK = """
[network]
ipv4_pool = "10.200.0.0/16"
uplink = "eth0"
public_egress = {public}
"""


def session(tmp_path: Path, extra: str = "") -> ControlSession:
    config = load(NodeConfig, write_config(tmp_path, extra=extra))
    manager = RecordingInstances()
    sampler = UsageSampler(config.host.proc_root, manager)
    return ControlSession(config, store_identity(config), 1,
                          clock=NodeClock(config.testing.clock_skew_file), sampler=sampler,
                          board=ReportBoard(manager, sampler.tightness), instances=manager)


def test_no_network_section_no_fact(tmp_path: Path) -> None:
    facts = session(tmp_path).facts()
    assert "network" not in facts
    assert facts["pools"] == [{"id": "pool-a", "shared": False, "default": True}]


def test_the_fact_follows_public_egress(tmp_path: Path) -> None:
    for public in (True, False):
        base = tmp_path / str(public)
        base.mkdir()
        s = session(base, NETWORK.format(public="true" if public else "false"))
        assert s.facts()["network"] == {"public_egress": public}
        hello = s.hello()
        assert Hello.model_validate(hello.to_wire()).facts["network"] == {
            "public_egress": public}
