"""One valid ``args`` object per node command, as ctrl sends them, for the protocol
tests to start from and spoil one field at a time."""

from __future__ import annotations

import copy
from typing import Any

MIB = 1 << 20
HEX = "ab" * 32

TEMPLATE = {"name": "base-1", "image_digest": f"sha256:{HEX}",
            "kernel_digest": f"sha256:{'cd' * 32}", "initramfs_digest": f"sha256:{'ef' * 32}"}

GOOD_ARGS: dict[str, dict[str, Any]] = {
    "instance.create": {
        "instance_id": "inst-1", "workspace_id": "ws-1", "template": TEMPLATE,
        "cpu_millis": 1000, "memory_bytes": 256 * MIB,
        "layer": {"pool_id": "pool-a", "ref": "lay-1", "capacity_bytes": 64 * MIB,
                  "epoch": 1, "create": True},
        "volumes": [{"volume_id": "vol-1", "pool_id": "pool-a", "epoch": 2,
                     "mount_point": "/data"}],
        "launch": {"hostname": "ws-1", "env": {"GREETING": "hi"}},
    },
    "instance.stop": {"instance_id": "inst-1", "force": False, "deadline_s": 30.0},
    "instance.destroy": {"instance_id": "inst-1"},
    "node.drain": {"requested": True},
    "layer.delete": {"pool_id": "pool-a", "ref": "lay-1", "epoch": 3},
    "volume.create": {"volume_id": "vol-1", "pool_id": "pool-a", "capacity_bytes": 64 * MIB,
                      "epoch": 1},
    "volume.delete": {"volume_id": "vol-1", "pool_id": "pool-a", "epoch": 1},
    "object.expand": {"kind": "volume", "pool_id": "pool-a", "object_id": "vol-1",
                      "epoch": 2, "capacity_bytes": 128 * MIB},
    "object.copy": {"kind": "retained_layer", "object_id": "lay-1",
                    "from_pool_id": "pool-a", "to_pool_id": "pool-b", "epoch": 2},
    "object.export": {"kind": "volume", "pool_id": "pool-a", "object_id": "vol-1",
                      "epoch": 2},
    "object.import": {"kind": "volume", "pool_id": "pool-a", "object_id": "vol-1",
                      "artifact_digest": f"sha256:{HEX}", "epoch": 1},
    "registry.list": {"limit": 100},
    "registry.delete": {"instance_ids": ["inst-1", "inst-2"]},
    "instance.set_network": {
        "instance_id": "inst-1", "revision": 2,
        "network": {"public_egress": True, "allow_out": ["198.18.1.1/32"],
                    "deny_out": ["0.0.0.0/0", "::/0"], "egress": None, "resolver": None}},
}


def good(command: str, /, **changes: Any) -> dict[str, Any]:
    """A deep copy of `command`'s example with top-level `changes` applied."""
    args = copy.deepcopy(GOOD_ARGS[command])
    args.update(changes)
    return args
