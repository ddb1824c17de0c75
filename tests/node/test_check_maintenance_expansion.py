"""check-maintenance (spec: node-and-vmm-processes, "Pre-replacement check"): for
``--operation upgrade``, "Detached Volumes and retained layers may stay, including
Volumes whose resize has not finished"; ``remove`` still requires none.

An unfinished expansion is what a node killed between two steps leaves in the object's
metadata (``expansion: {target_bytes, step}``, tests/node/test_object_expand.py); the
next node finishes it when ctrl asks again.
"""

from __future__ import annotations

from pathlib import Path

from instance_harness import registries
from upgrade_harness import left_node

from kibotos.core import atomicfile
from kibotos.node.checks import maintenance_check
from kibotos.node.runtime.build_identity import BuildIdentity

N = BuildIdentity(release="0.4.0")


def tree(base: Path) -> list[Path]:
    return sorted(p.relative_to(base) for p in base.rglob("*"))


async def test_an_unfinished_expansion_of_a_detached_layer_may_stay() -> None:
    async with left_node(N, stop_instance=True) as node:
        base = node.root.parent
        meta_path = node.pool / "retained-layers" / "metadata" / "ws-1.json"
        meta = atomicfile.read_json(meta_path)
        assert meta.get("expansion") is None
        meta["expansion"] = {"target_bytes": 64 << 30, "step": "resize"}
        atomicfile.write_json(meta_path, meta, mode=0o600)
        before = tree(base)

        upgrade = await maintenance_check.run(node.config, "upgrade",
                                              registries=registries())
        assert upgrade.exit_code == 0, upgrade.render()
        assert any("1 detached Volumes and retained layers stay held by this node" in line
                   for line in upgrade.of("ok"))
        remove = await maintenance_check.run(node.config, "remove", registries=registries())
        assert remove.exit_code != 0
        assert any("retained layer ws-1" in line for line in remove.of("blocked"))
        # Read-only: the unfinished expansion is left for the node to finish.
        assert atomicfile.read_json(meta_path)["expansion"] == {"target_bytes": 64 << 30,
                                                                "step": "resize"}
        assert tree(base) == before
