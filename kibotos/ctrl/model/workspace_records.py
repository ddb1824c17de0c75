"""Workspace records: states and their transitions, the Workspace JSON, and the reads.

States (docs/architecture.md, "Workspaces, Instances, use rights")::

    CREATING ──► AVAILABLE ──► STOPPING ──► STOPPED ──► STARTING ──► AVAILABLE
        │            │             │           │
        └────────────┴──── * ──► FAILED ───────┴──► DELETING ──► DELETED

Every transition goes through `transition`, which bumps the revision (the Workspace's
expected revision) and writes an ``events`` row ``{from, to, cause}``, so the history
of a Workspace can always be read back.  Everything here runs inside one store
transaction; the orchestration that talks to nodes is in `workspace_ops`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from pydantic.config import JsonDict
from sqlalchemy import and_, select
from sqlalchemy.orm import Session

from kibotos.core import ids
from kibotos.core.errors import InvalidArgument, check_expected_version
from kibotos.ctrl.model.nodes import record_event, record_transition
from kibotos.ctrl.model.page_tokens import decode_token, encode_token
from kibotos.ctrl.store.models import Instance, Workspace, WorkspaceLabel, existing
from kibotos.ctrl.wire.base import iso

CREATING = "CREATING"
STARTING = "STARTING"
AVAILABLE = "AVAILABLE"
STOPPING = "STOPPING"
STOPPED = "STOPPED"
FAILED = "FAILED"
DELETING = "DELETING"
DELETED = "DELETED"
STATES = (CREATING, STARTING, AVAILABLE, STOPPING, STOPPED, FAILED, DELETING, DELETED)
#: States a caller waits for: nothing happens to the Workspace until someone acts.
SETTLED = frozenset({AVAILABLE, STOPPED, FAILED, DELETED})

#: Reasons of docs/architecture.md's table of node events.
EXITED_REASON = "node reports the Instance as no longer running"
OOM_REASON = "OOM_KILLED"
UNAVAILABLE_REASON = "UNAVAILABLE"

MAX_LABELS = 32
#: `check_labels`' rule as a labels field's JSON schema (ctrl's OpenAPI document).
LABELS_SCHEMA: JsonDict = {
    "maxProperties": MAX_LABELS,
    "propertyNames": {"pattern": ids.schema_pattern(ids.LABEL_KEY)},
    "additionalProperties": {"type": "string", "pattern": ids.schema_pattern(ids.LABEL_VALUE)},
}


def check_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """Label keys as `ids.check_label_key`; values up to 63 letters, digits and
    ``. _ -`` (starting and ending alphanumeric), or empty."""
    if len(labels) > MAX_LABELS:
        raise InvalidArgument(f"at most {MAX_LABELS} labels, got {len(labels)}")
    for key, value in labels.items():
        ids.check_label_key(key)
        if not isinstance(value, str) or not ids.LABEL_VALUE.fullmatch(value):
            raise InvalidArgument(
                f"invalid value {value!r} of label {key!r}: up to 63 letters, digits and "
                ". _ -, starting and ending with a letter or digit")
    return dict(labels)


def new_workspace(*, workspace_id: str, template: Mapping[str, str], labels: dict[str, str],
                  cpu_millis: int, memory_bytes: int, layer_size_bytes: int,
                  layer_pool_id: str, layer_ref: str, now: datetime,
                  network_policy: Mapping[str, Any] | None = None) -> Workspace:
    """A new Workspace record; `network_policy` None is the deployment default
    (`kibotos.ctrl.model.network_policy`)."""
    policy = None if network_policy is None else dict(network_policy)
    return Workspace(
        network_policy=policy, network_revision=1,
        network_egress=None if policy is None else policy.get("egress"),
        network_resolver=None if policy is None else policy.get("resolver"),
        workspace_id=workspace_id, template_name=template["name"],
        image_digest=template["image_digest"], kernel_digest=template["kernel_digest"],
        initramfs_digest=template["initramfs_digest"], labels=labels, state=CREATING,
        reason=None, revision=1, cpu_millis=cpu_millis, memory_bytes=memory_bytes,
        layer_size_bytes=layer_size_bytes, layer_pool_id=layer_pool_id, layer_ref=layer_ref,
        current_instance_id=None, node_id=None, last_instance_id=None, last_node_id=None,
        stop_force=False, created_at=now, updated_at=now, deleted_at=None)


def add_workspace(session: Session, ws: Workspace, cause: str, now: datetime) -> None:
    """Insert a new Workspace with its labels and the event of its first state."""
    session.add(ws)
    for key, value in ws.labels.items():
        session.add(WorkspaceLabel(workspace_id=ws.workspace_id, key=key, value=value))
    record_event(session, now, ws.workspace_id, "transition",
                 {"from": None, "to": ws.state, "cause": cause})


def transition(session: Session, ws: Workspace, to: str, cause: str, now: datetime, *,
               reason: str | None = None) -> None:
    """Move `ws` to state `to` (its reason replaced by `reason`), record why."""
    record_transition(session, ws.workspace_id, ws, to, cause, now, reason=reason)


def set_executing(ws: Workspace, instance_id: str, node_id: str) -> None:
    ws.current_instance_id = instance_id
    ws.node_id = node_id
    ws.last_instance_id = instance_id
    ws.last_node_id = node_id


def clear_executing(ws: Workspace) -> None:
    """The current Instance no longer holds anything: the Workspace runs nowhere."""
    ws.current_instance_id = None
    ws.node_id = None


def get_workspace(session: Session, workspace_id: str, *,
                  for_update: bool = False) -> Workspace:
    return existing(session, Workspace, workspace_id, "workspace", "workspace_id",
                    for_update=for_update)


def check_revision(ws: Workspace, expected: int | None) -> None:
    check_expected_version("workspace", "workspace_id", ws.workspace_id, ws.revision, expected)


# ------------------------------------------------------------------------ rendering


def workspace_json(ws: Workspace, instance: Instance | None = None) -> dict[str, Any]:
    """The ``Workspace`` of the API.  `instance` (the last one, for ``get``) adds what
    its node reported: guest facts and whether the last stop was confirmed on disk."""
    out: dict[str, Any] = {
        "workspace_id": ws.workspace_id,
        "template": {"name": ws.template_name, "image_digest": ws.image_digest,
                     "kernel_digest": ws.kernel_digest,
                     "initramfs_digest": ws.initramfs_digest},
        "labels": dict(ws.labels),
        "state": ws.state,
        "reason": ws.reason,
        "revision": ws.revision,
        "resources": {"cpu_millis": ws.cpu_millis, "memory_bytes": ws.memory_bytes},
        "layer": {"pool_id": ws.layer_pool_id, "ref": ws.layer_ref,
                  "size_bytes": ws.layer_size_bytes, "handoff": ws.layer_handoff},
        "network": {"policy": ws.network_policy, "revision": ws.network_revision},
        "node_id": ws.node_id,
        "instance_id": ws.current_instance_id,
        "last_node_id": ws.last_node_id,
        "last_instance_id": ws.last_instance_id,
        "created_at": iso(ws.created_at),
        "updated_at": iso(ws.updated_at),
        "deleted_at": iso(ws.deleted_at),
        "instance": None,
    }
    if instance is not None:
        out["instance"] = {"instance_id": instance.instance_id, "node_id": instance.node_id,
                           "state": instance.state, "reason": instance.reason,
                           "guest": instance.guest,
                           "confirmed_on_disk": instance.confirmed_on_disk,
                           "network": instance.network,
                           "network_revision": instance.network_revision,
                           "addresses": instance.addresses}
    return out


def location_json(ws: Workspace) -> dict[str, Any]:
    return {"workspace_id": ws.workspace_id, "node_id": ws.node_id,
            "instance_id": ws.current_instance_id}


# ------------------------------------------------------------------------ reads


def _page(rows: Sequence[Workspace], page_size: int) -> tuple[list[Workspace], str | None]:
    if len(rows) > page_size:
        kept = list(rows[:page_size])
        return kept, encode_token(kept[-1].workspace_id)
    return list(rows), None


def list_page(session: Session, *, states: Sequence[str], labels: Mapping[str, str],
              page_size: int, page_token: str | None
              ) -> tuple[list[Workspace], str | None]:
    """Workspaces in ID order (keyset paging).  Without `states`, DELETED ones are left
    out; every label must match."""
    query = select(Workspace).order_by(Workspace.workspace_id).limit(page_size + 1)
    if states:
        query = query.where(Workspace.state.in_(list(states)))
    else:
        query = query.where(Workspace.state != DELETED)
    for i, (key, value) in enumerate(sorted(labels.items())):
        alias = select(WorkspaceLabel).where(
            WorkspaceLabel.key == key, WorkspaceLabel.value == value).subquery(f"l{i}")
        query = query.join(alias, alias.c.workspace_id == Workspace.workspace_id)
    if page_token:
        query = query.where(Workspace.workspace_id > decode_token(page_token))
    return _page(session.scalars(query).all(), page_size)


def locations_page(session: Session, *, node_id: str | None, instance_id: str | None,
                   page_size: int, page_token: str | None
                   ) -> tuple[list[Workspace], str | None]:
    """Workspaces executing on `node_id`, or as the current Instance `instance_id`."""
    query = select(Workspace).order_by(Workspace.workspace_id).limit(page_size + 1)
    if node_id is not None:
        query = query.where(Workspace.node_id == node_id)
    else:
        query = query.where(and_(Workspace.current_instance_id == instance_id,
                                 Workspace.node_id.is_not(None)))
    if page_token:
        query = query.where(Workspace.workspace_id > decode_token(page_token))
    return _page(session.scalars(query).all(), page_size)
