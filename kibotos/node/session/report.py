"""The node's full report and the signal that it changed.

A report goes to ctrl in ``hello`` and again whenever it changes (memory tightness
flips, counts change).  Changes are counted rather than queued: a session that was
down while three changes happened sends one report with the state of now.
"""

from __future__ import annotations

import trio

from kibotos.node.host.usage import MemoryTightness
from kibotos.node.instances.contract import InstanceManager
from kibotos.protocol import ReportFields


class ReportBoard:
    """Builds the report from its sources and wakes whoever waits for a change."""

    def __init__(self, instances: InstanceManager, tightness: MemoryTightness) -> None:
        self.instances = instances
        self.tightness = tightness
        self.version = 0
        self._changed = trio.Event()

    def report(self) -> ReportFields:
        """The full report, built as the protocol's `ReportFields`."""
        body = self.instances.holdings().to_wire()
        body["memory_tight"] = self.tightness.tight
        since = self.tightness.since
        body["memory_tight_since"] = since.isoformat() if since else None
        return ReportFields.model_validate(body)

    def mark_changed(self) -> None:
        """Called by the sources (sampler on a flip, Instance manager on a count change);
        safe from any trio task, never blocks."""
        self.version += 1
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self, seen: int) -> int:
        """Return the current version once it is past `seen`."""
        while self.version <= seen:
            await self._changed.wait()
        return self.version
