"""`SortedPlacementPolicy`: a placement policy that is only its sort key.

Both built-in policies (``binpack``, ``spread``) take no options and rank the
candidates by a key of each alone, which is what `kibotos.sdk.KeyedPlacementPolicy`
promises ctrl.  The constructor, the option check and `rank` were the same in both;
here they are written once, and a policy says only its `name` and its `sort_key`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from kibotos.backends import KeyedPlacementPolicy, NodeCapacity, PlacementRequest
from kibotos.sdk.options import backend_options


class SortedPlacementPolicy(KeyedPlacementPolicy):
    """Takes no options (any is refused, in the one format) and ranks by `sort_key`."""

    name: ClassVar[str]

    def __init__(self, options: Mapping[str, Any]) -> None:
        backend_options("placement", self.name, options)

    def sort_key(self, request: PlacementRequest, candidate: NodeCapacity) -> Any:
        raise NotImplementedError

    def rank(self, request: PlacementRequest, candidates: Sequence[NodeCapacity]) -> list[str]:
        return [node.node_id
                for node in sorted(candidates, key=lambda c: self.sort_key(request, c))]
