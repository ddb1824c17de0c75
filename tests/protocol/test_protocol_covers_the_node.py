"""Every command the node answers has its arguments' type in `kibotos.protocol`: the
real node's handler table (a manager built as the node builds it, with the credential
that registers ``object.export``/``object.import``) and the simulated node's are walked,
and each name must be in `COMMANDS`, and each type's name must be answered by the node."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from kibotos.config import NodeConfig, parse
from kibotos.node.instances.setup import build_instance_manager
from kibotos.plugins import load_plugins
from kibotos.protocol import COMMANDS
from kibotos.testing.sim_instances import SimInstances

TESTPLUGINS = Path(__file__).resolve().parent.parent / "testplugins"


def node_config(base: Path) -> NodeConfig:
    text = f"""
[node]
id = "node-a"
ctrl_url = "http://127.0.0.1:9"
[storage]
root = "{base / 'root'}"
[[storage.pool]]
id = "pool-a"
path = "{base / 'pool'}"
[resources]
cpu = 1
memory = "1G"
[vmm]
backend = "testvmm"
artifact_dirs = ["{base / 'artifacts'}"]
"""
    return parse(NodeConfig, tomllib.loads(text), "test node.toml")


def node_command_names(base: Path) -> set[str]:
    if str(TESTPLUGINS) not in sys.path:
        sys.path.insert(0, str(TESTPLUGINS))
    manager = build_instance_manager(
        node_config(base), memory_tight=lambda: False, credential=lambda: "credential",
        registries=load_plugins(test_modules=["kibotos_testvmm"]))
    return set(manager.command_handlers())


def test_every_command_the_node_answers_has_a_protocol_type(tmp_path: Path) -> None:
    names = node_command_names(tmp_path)
    assert names - set(COMMANDS) == set(), "add the arguments to kibotos.protocol.commands"
    assert set(COMMANDS) - names == set(), "a protocol type for a command no node answers"


def test_every_command_the_simulated_node_answers_has_a_protocol_type() -> None:
    sim = SimInstances()
    assert {k for k in SimInstances.KINDS if sim.handles(k)} <= set(COMMANDS)
