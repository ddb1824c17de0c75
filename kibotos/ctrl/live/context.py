"""What every part of a running ctrl shares: config, store, live sessions, plugins.

Built once by `serve_ctrl` (or by a test) and handed to the live services
(`serve.build_services`), which the ASGI app is built on; nothing here is module-global,
so several ctrl instances can run in one process (tests, benchmarks).  The services are
not in here: they take the context, never the reverse.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

from kibotos.config import CtrlConfig
from kibotos.core.credentials import SigningKey
from kibotos.ctrl.api.metrics import CtrlMetrics
from kibotos.ctrl.model.nodes import IsolateReleaser
from kibotos.ctrl.store.db import Store
from kibotos.ctrl.store.secret_box import SecretBox
from kibotos.plugins import Registries
from kibotos.protocol import Args, CloseReason
from kibotos.tls.ca import ClusterCA


def utcnow() -> datetime:
    return datetime.now(UTC)


class SessionRegistry(Protocol):
    """The live control sessions of this ctrl process (implemented in `session.py`)."""

    def is_alive(self, node_id: str) -> bool:
        """Whether the node has a live control session right now."""

    def elsewhere(self) -> AbstractSet[str]:
        """The nodes whose live session another ctrl replica holds, so that commands to
        them travel through the relay (empty for a lone ctrl)."""

    async def close(self, node_id: str, reason: CloseReason) -> None:
        """Send ``close{reason}`` to the node's session (if any) and end it."""

    def push_overcommit(self, node_id: str) -> None:
        """Send the node its current overcommit ratios (read from the store) soon."""

    async def call(self, node_id: str, args: Args, timeout: float) -> dict[str, object]:
        """Send ``command{kind,args}`` (the kind is `args`' type's) over the session and
        wait for its result."""


@dataclass
class CtrlContext:
    config: CtrlConfig
    store: Store
    registries: Registries
    sessions: SessionRegistry
    now: Callable[[], datetime] = field(default=utcnow)
    #: Parts of ctrl that own objects a node holds (use rights, Allocations,
    #: Workspaces, pending commands) register here; isolate calls each in its
    #: transaction and reports the summed counts.
    isolate_releasers: list[IsolateReleaser] = field(default_factory=list)
    #: Signs session credentials (``<state_dir>/session-signing.key``); its public key
    #: goes to every node in ``welcome.session_signing_public_key``.
    session_signing_key: SigningKey | None = None
    #: This ctrl's Prometheus counters, in a registry of its own (docs/metrics.md).
    metrics: CtrlMetrics = field(default_factory=CtrlMetrics)
    #: Seals Egress passwords in the store (``<state_dir>/egress-secrets.key``).
    secrets: SecretBox | None = None
    #: The cluster CA (``<state_dir>/cluster-ca.{key,crt}``): issues ctrl's own and the
    #: data planes' certificates; its certificate goes to every enrolling identity.
    cluster_ca: ClusterCA | None = None
