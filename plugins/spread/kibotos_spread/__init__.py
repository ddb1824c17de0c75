"""Built-in placement policy ``spread``: put each Workspace on the emptiest node.

Spreading keeps the load even, so one busy node hurts as few Workspaces as possible and
each keeps the most room to grow into overcommit.  The node with the largest share left
free once the request is placed (`kibotos.sdk.NodeCapacity.free_share_after`, CPU
and memory combined) ranks first; ties go to the node running fewer Instances, then to
the lower node ID, so the same inputs always give the same ranking.

Registered through the plugin SDK (`kibotos.sdk`) only, like any third-party plugin.
"""

from __future__ import annotations

from typing import ClassVar

from kibotos.sdk import NodeCapacity, PlacementRequest, Register, SortedPlacementPolicy, hookimpl

__all__ = ["SpreadPolicy", "kibotos_register_placement"]


class SpreadPolicy(SortedPlacementPolicy):
    """Ranks candidates by most free share after placing the request."""

    name: ClassVar[str] = "spread"

    def sort_key(self, request: PlacementRequest,
                 candidate: NodeCapacity) -> tuple[int, int, str]:
        """Most free share first (the exact integer key, negated), then fewer Instances,
        then the lower node ID."""
        return (-candidate.free_share_key_after(request), candidate.instance_count,
                candidate.node_id)


@hookimpl
def kibotos_register_placement(register: Register) -> None:
    register(SpreadPolicy)
