"""The Egress revisions ctrl is handing a node right now, before the store says so.

A node fetches an Egress's credentials (``GET /v1/egresses/{name}/credentials``) only
for a revision that an Instance it runs was sent, and ctrl checks that in the store
(`network_records.node_may_fetch`).  But a create is recorded only once its node
accepted it, and the node may set up the Instance's network (and fetch the
credentials) before that commit; a network switch is recorded only after the node
applied it, and the node fetches the new revision while applying it.  So while such a
command is out, its (node, Egress, revision) is held here, and the credentials check
accepts what is held as well as what is stored.  It is memory of this ctrl process
only: with several ctrl replicas a node's fetch may reach another one, which then
answers from the store alone (the node retries).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

from kibotos.protocol import NetworkPolicy


class PendingGrants:
    def __init__(self) -> None:
        self._held: dict[int, tuple[str, str, int]] = {}
        self._ids = itertools.count()

    @contextmanager
    def scope(self) -> Iterator[GrantScope]:
        """Grants added in the block are held until it ends."""
        scope = GrantScope(self)
        try:
            yield scope
        finally:
            for key in scope.keys:
                self._held.pop(key, None)

    def _add(self, node_id: str, name: str, revision: int) -> int:
        key = next(self._ids)
        self._held[key] = (node_id, name, revision)
        return key

    def allows(self, node_id: str, name: str, revision: int) -> bool:
        return (node_id, name, revision) in self._held.values()


class GrantScope:
    def __init__(self, grants: PendingGrants) -> None:
        self._grants = grants
        self.keys: list[int] = []

    def add(self, node_id: str, policy: NetworkPolicy | None) -> None:
        """Hold the Egress of `policy` (if it has one) for `node_id`."""
        if policy is not None and policy.egress is not None:
            self.keys.append(self._grants._add(node_id, policy.egress.name,
                                               policy.egress.revision))
