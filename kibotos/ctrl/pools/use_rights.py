"""Use rights of pool objects: which node may open a retained layer or a Volume, and at
which epoch (docs/architecture.md, "Workspaces, Instances, use rights"; the node side is
spec/storage-pools-on-nfs.txt, "Epochs and takeover").

One row per object.  Granting to a node other than the last holder, or granting again
after an isolate released it, increments the epoch; the node refuses to open a block
file whose holder record carries a newer epoch than its command, so a node that kept
running after an isolate can never write over its successor.  A normal stop keeps the
holder for an object in a node's private pool (nobody else can reach it) and releases
it, keeping the epoch, for an object in a shared pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from kibotos.ctrl.store.models import UseRight

RETAINED_LAYER = "retained_layer"
VOLUME = "volume"


def new_right(*, kind: str, object_id: str, workspace_id: str, pool_id: str, shared: bool,
              now: datetime) -> UseRight:
    """An object nobody has held yet (epoch 0; the first grant makes it 1)."""
    return UseRight(object_kind=kind, object_id=object_id, workspace_id=workspace_id,
                    pool_id=pool_id, pool_shared=shared, holder_node_id=None,
                    last_holder_node_id=None, epoch=0, bump_on_grant=False, updated_at=now)


def epoch_for(right: UseRight, node_id: str) -> int:
    """The epoch a grant of `right` to `node_id` carries."""
    last = right.holder_node_id or right.last_holder_node_id
    if last == node_id and not right.bump_on_grant and right.epoch > 0:
        return right.epoch
    return right.epoch + 1


def grant(right: UseRight, node_id: str, now: datetime) -> int:
    """Give `node_id` the use right; returns the epoch it holds it at."""
    right.epoch = epoch_for(right, node_id)
    right.holder_node_id = node_id
    right.last_holder_node_id = node_id
    right.bump_on_grant = False
    right.updated_at = now
    return right.epoch


def release_after_stop(right: UseRight, now: datetime) -> None:
    """A normal stop: shared pool → nobody holds it (epoch kept); private pool → the
    node keeps it (it is the only one that can reach the pool anyway)."""
    if right.pool_shared and right.holder_node_id is not None:
        right.holder_node_id = None
        right.updated_at = now


def rights_of(session: Session, workspace_id: str, *,
              for_update: bool = False) -> Sequence[UseRight]:
    query = select(UseRight).where(UseRight.workspace_id == workspace_id).order_by(
        UseRight.object_kind, UseRight.object_id)
    if for_update:
        query = query.with_for_update()
    return session.scalars(query).all()


def release_for_isolate(session: Session, node_id: str, now: datetime) -> tuple[int, int]:
    """Release everything `node_id` holds, in every pool; the next grant bumps the epoch
    even to the same node.  Returns (Volumes, retained layers) released."""
    volumes = layers = 0
    rows = session.scalars(
        select(UseRight).where(UseRight.holder_node_id == node_id).with_for_update())
    for right in rows:
        right.holder_node_id = None
        right.bump_on_grant = True
        right.updated_at = now
        if right.object_kind == VOLUME:
            volumes += 1
        else:
            layers += 1
    return volumes, layers
