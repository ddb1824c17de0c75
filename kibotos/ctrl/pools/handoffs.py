"""How a Workspace's writable layer and its Volumes last changed hands, from what the
node says about the objects an Instance opened (``objects`` of ``instance_state``
frames and of ``hello``/``report`` entries, docs/architecture.md).

The node tells, per object, ``released_cleanly``: true when the previous holder's
release (a normal stop) or its receipt was there, false when it opened the object after
waiting the maximum time for a receipt that never came (spec: storage-pools-on-nfs,
"Epochs and takeover"), null when the open was no handoff (a new object, a retry, the
node adopting a running Instance).  ctrl keeps the last one that was a handoff:

* ``CLEAN`` / ``UNKNOWN`` on ``workspaces.layer_handoff`` and ``volumes.handoff``;
* null leaves it as it is, so a layer that never changed hands shows nothing and an
  UNKNOWN stays while that Instance runs, after it stops and across node restarts;
* the next start after a normal stop is a clean handoff (on any node, the same one
  included: it finds its own clean release), so it shows CLEAN again.

Only the Workspace's current Instance counts, and only at the epoch ctrl granted: a
report of an Instance ctrl no longer wants (e.g. from a node that was isolated) must
not overwrite what its successor found.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from kibotos.ctrl.model.nodes import record_event
from kibotos.ctrl.pools import use_rights
from kibotos.ctrl.store.models import UseRight, Volume, Workspace

CLEAN = "CLEAN"
UNKNOWN = "UNKNOWN"
#: The node's object kinds (its pool directories) → ctrl's use-right kinds.
NODE_KINDS = {"retained-layers": use_rights.RETAINED_LAYER, "volumes": use_rights.VOLUME}


def state_of(released_cleanly: object) -> str | None:
    """CLEAN / UNKNOWN for a handoff, None for an open that was none."""
    if released_cleanly is True:
        return CLEAN
    if released_cleanly is False:
        return UNKNOWN
    return None


def note_objects(session: Session, *, node_id: str, instance_id: str, workspace_id: str,
                 objects: Iterable[Any], now: datetime) -> None:
    """Store the handoffs node `node_id` reports for Instance `instance_id` (see the
    module docstring), each change also as an event of the Workspace or Volume (kind
    ``handoff``); entries that are not well-formed objects are skipped."""
    ws: Workspace | None = None
    for item in objects:
        if not isinstance(item, dict):
            continue
        state = state_of(item.get("released_cleanly"))
        kind = NODE_KINDS.get(str(item.get("kind")))
        object_id, epoch = item.get("object_id"), item.get("epoch")
        if state is None or kind is None or not isinstance(object_id, str) \
                or not isinstance(epoch, int):
            continue
        if ws is None:
            ws = session.get(Workspace, workspace_id, with_for_update=True)
            if ws is None or ws.current_instance_id != instance_id:
                return
        right = session.get(UseRight, (kind, object_id))
        if right is None or right.workspace_id != workspace_id or right.epoch != epoch:
            continue
        detail = {"object_kind": kind, "object_id": object_id, "handoff": state,
                  "node_id": node_id, "instance_id": instance_id, "epoch": epoch}
        if kind == use_rights.RETAINED_LAYER:
            if object_id == ws.layer_ref and ws.layer_handoff != state:
                ws.layer_handoff = state
                record_event(session, now, workspace_id, "handoff", detail)
        else:
            vol = session.get(Volume, object_id, with_for_update=True)
            if vol is not None and vol.handoff != state:
                vol.handoff = state
                record_event(session, now, object_id, "handoff", detail)
