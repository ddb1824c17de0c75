"""Committed Allocation changes announced to the other ctrl replicas (PostgreSQL).

Each replica places on its own in-memory index (`kibotos.ctrl.model.placement`), which
its own commits keep true (`kibotos.ctrl.live.store_watch`).  Another replica's
placements used to reach it only through the index's resync once a minute, so under
load two replicas kept choosing the same node, the later one's locked re-check in the
store (`workspace_txns.verify_node`) refused it, and the Instance the node had already
accepted was destroyed again: most of the work of a create spent for nothing.

So every transaction that writes Allocations says which, in one ``NOTIFY`` per
`MAX_PAYLOAD` bytes on `CHANNEL`, sent from a ``before_commit`` hook and delivered by
PostgreSQL only if it commits, in commit order.  The payload is the snapshot itself
(one line per Allocation: ``<replica> <instance> <node> <cpu> <memory> <released>``),
so a listener applies it without reading the store.  A lost notification (a listener
reconnecting) costs what it cost before: the minute resync, and the re-check keeps
placements correct meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from sqlalchemy.orm import Session

from kibotos.ctrl.store import relay_queue as q
from kibotos.ctrl.store.changes import INFO_KEY, AllocationSnapshot

log = logging.getLogger("kibotos.ctrl.store.allocation_notes")

CHANNEL = "kibotos_allocations"
#: PostgreSQL refuses a payload of 8,000 bytes or more.
MAX_PAYLOAD = 7000
_FIELDS = 6


def encode(replica_id: str, allocations: list[AllocationSnapshot]) -> Iterator[str]:
    """The payloads announcing `allocations`, each under `MAX_PAYLOAD` bytes."""
    lines: list[str] = []
    size = 0
    for a in allocations:
        line = (f"{replica_id} {a.instance_id} {a.node_id} {a.cpu_millis} "
                f"{a.memory_bytes} {int(a.released)}")
        if lines and size + len(line) + 1 > MAX_PAYLOAD:
            yield "\n".join(lines)
            lines, size = [], 0
        lines.append(line)
        size += len(line) + 1
    if lines:
        yield "\n".join(lines)


def decode(payload: str) -> list[tuple[str, AllocationSnapshot]]:
    """(replica, snapshot) per line; a malformed line is logged and skipped (the
    payload comes from our own replicas, so one means a version mismatch or a bug)."""
    out: list[tuple[str, AllocationSnapshot]] = []
    for line in payload.split("\n"):
        fields = line.split(" ")
        if len(fields) != _FIELDS or not all(f.isascii() and f for f in fields) or \
                not (fields[3].isdigit() and fields[4].isdigit()) or fields[5] not in ("0", "1"):
            log.warning("allocation notice not understood: %r", line[:200])
            continue
        replica_id, instance_id, node_id, cpu, mem, released = fields
        out.append((replica_id, AllocationSnapshot(instance_id, node_id, int(cpu), int(mem),
                                                   released == "1")))
    return out


def announcer(replica_id: str) -> Callable[[Session], None]:
    """The ``before_commit`` hook: flush (so every written Allocation, through the ORM
    or noted after a Core insert, is in the transaction's snapshots), then NOTIFY them."""
    def hook(session: Session) -> None:
        session.flush()
        changes = session.info.get(INFO_KEY)
        if not changes:
            return
        allocations = [c for c in changes.values() if isinstance(c, AllocationSnapshot)]
        for payload in encode(replica_id, allocations):
            q.notify(session, CHANNEL, payload)
    return hook
