"""Built-in placement policy ``binpack`` (the default): fill the fullest node first.

Packing Workspaces onto as few nodes as possible keeps whole nodes empty, so they can be
drained, retired or handed a large Workspace later.  The measure is the share of the
node left free once the request is placed, CPU and memory combined
(`kibotos.sdk.NodeCapacity.free_share_after`); the smallest share ranks first and
ties go to the lower node ID, so the same inputs always give the same ranking.

Registered through the plugin SDK (`kibotos.sdk`) only, like any third-party plugin.
"""

from __future__ import annotations

from typing import ClassVar

from kibotos.sdk import NodeCapacity, PlacementRequest, Register, SortedPlacementPolicy, hookimpl

__all__ = ["BinpackPolicy", "kibotos_register_placement"]


class BinpackPolicy(SortedPlacementPolicy):
    """Ranks candidates by least free share after placing the request."""

    name: ClassVar[str] = "binpack"

    def sort_key(self, request: PlacementRequest, candidate: NodeCapacity) -> tuple[int, str]:
        """Least free share first (as the exact integer key), then the lower node ID."""
        return (candidate.free_share_key_after(request), candidate.node_id)


@hookimpl
def kibotos_register_placement(register: Register) -> None:
    register(BinpackPolicy)
