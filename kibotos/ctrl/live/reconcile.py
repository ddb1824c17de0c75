"""Reconciliation: every ``reconcile_interval``, measure each live node's clock and fetch
its latest host usage sample.

The clock measurement feeds the 30 s placement gate; the usage sample is for people
(``kibo node get``) and never affects placement.  Nodes are measured concurrently, so
one slow node delays nobody else, and a failure is logged and retried next round.
"""

from __future__ import annotations

import logging

import trio

from kibotos.core.errors import KibotosError
from kibotos.ctrl.live.node_sessions import NodeSession, SessionHub
from kibotos.protocol import ProtocolError

log = logging.getLogger("kibotos.ctrl.live.reconcile")


async def _measure(session: NodeSession) -> None:
    for step in (session.measure_clock, session.fetch_usage):
        try:
            await step()
        except (KibotosError, ProtocolError) as exc:
            log.warning("reconcile: node %s %s failed: %s", session.node_id,
                        step.__name__, exc)


async def reconcile_once(hub: SessionHub) -> int:
    """One round over the sessions live now; returns how many were visited."""
    sessions = hub.live()
    async with trio.open_nursery() as nursery:
        for session in sessions:
            nursery.start_soon(_measure, session)
    return len(sessions)


async def run_reconcile(hub: SessionHub, interval: float, *,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Run rounds forever, one every `interval` seconds (measured start to start)."""
    task_status.started()
    next_round = trio.current_time() + interval
    while True:
        await trio.sleep_until(next_round)
        # A round slower than the interval delays the next; it never piles them up.
        next_round = max(next_round + interval, trio.current_time())
        try:
            count = await reconcile_once(hub)
        except KibotosError as exc:  # the store was unreachable; try again next round
            log.warning("reconcile round failed: %s", exc)
        else:
            log.debug("reconcile round: %d live sessions", count)
