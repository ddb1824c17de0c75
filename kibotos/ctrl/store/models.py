"""Tables of ctrl's store (SQLAlchemy 2 declarative).

Every change to a table here comes with an alembic migration in ``migrations/versions``;
`tests/ctrl/test_migrations.py` checks the two agree.  Quantities are exact integers:
CPU in millicores, memory in bytes, ratios in thousandths, times in UTC.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar, TypeVar

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Index, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from kibotos.core.errors import NotFound


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        datetime: DateTime(timezone=True),
        dict[str, Any]: JSON,
    }


class Identity(Base):
    """A long-lived identity obtained by exchanging an enrollment grant once."""

    __tablename__ = "identities"

    identity_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))  # "node" | "operator"
    node_id: Mapped[str | None] = mapped_column(String(63), index=True)
    name: Mapped[str | None] = mapped_column(String(128))
    grant_id: Mapped[str] = mapped_column(String(40))
    public_key: Mapped[str] = mapped_column(String(128))  # Ed25519, base64
    secret_hash: Mapped[str] = mapped_column(String(64))  # sha256 hex of the bearer secret
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]


class EnrollmentGrant(Base):
    """A one-time grant; exchanged at most once, then `used_at` is set."""

    __tablename__ = "enrollment_grants"

    grant_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    node_id: Mapped[str | None] = mapped_column(String(63))
    name: Mapped[str | None] = mapped_column(String(128))
    secret_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime]
    created_by: Mapped[str | None] = mapped_column(String(40))
    expires_at: Mapped[datetime | None]
    used_at: Mapped[datetime | None]
    identity_id: Mapped[str | None] = mapped_column(String(40))
    revoked_at: Mapped[datetime | None]


class Node(Base):
    """A node's registration record.  `registration_version` is its expected revision:
    session changes, resource reports and management operations all increment it."""

    __tablename__ = "nodes"

    node_id: Mapped[str] = mapped_column(String(63), primary_key=True)
    admission: Mapped[str] = mapped_column(String(16), default="admitted")  # admitted|revoked
    drain_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    isolated_incarnation: Mapped[int | None] = mapped_column(BigInteger)
    retired_at: Mapped[datetime | None]
    registration_version: Mapped[int] = mapped_column(BigInteger, default=1)
    created_at: Mapped[datetime]

    # Latest session
    incarnation: Mapped[int | None] = mapped_column(BigInteger)
    session_id: Mapped[str | None] = mapped_column(String(40))
    session_alive: Mapped[bool] = mapped_column(Boolean, default=False)
    #: The ctrl replica holding the session (`CtrlReplica`); ended when that one is gone.
    session_replica: Mapped[str | None] = mapped_column(String(40))
    session_started_at: Mapped[datetime | None]
    session_ended_at: Mapped[datetime | None]
    release_version: Mapped[str | None] = mapped_column(String(64))
    source_revision: Mapped[str | None] = mapped_column(String(64))
    clock_offset_ms: Mapped[float | None]
    clock_uncertainty_ms: Mapped[float | None]
    clock_sync_status: Mapped[str | None] = mapped_column(String(32))
    clock_measured_at: Mapped[datetime | None]

    # Latest full report
    report_at: Mapped[datetime | None]
    resources_cpu_millis: Mapped[int] = mapped_column(BigInteger, default=0)
    resources_memory_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    allocated_cpu_millis: Mapped[int] = mapped_column(BigInteger, default=0)
    allocated_memory_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    instance_count: Mapped[int] = mapped_column(Integer, default=0)
    volume_count: Mapped[int] = mapped_column(Integer, default=0)
    memory_tight: Mapped[bool] = mapped_column(Boolean, default=False)
    memory_tight_since: Mapped[datetime | None]
    host_usage: Mapped[dict[str, Any] | None]
    host_usage_at: Mapped[datetime | None]
    dataplane_address: Mapped[str | None] = mapped_column(String(255))
    node_facts: Mapped[dict[str, Any] | None]  # backend, acceleration, pools, ...

    # Overcommit overrides (thousandths; None = cluster default) and the node's confirmation
    overcommit_cpu: Mapped[int | None] = mapped_column(Integer)
    overcommit_memory: Mapped[int | None] = mapped_column(Integer)
    overcommit_sent_serial: Mapped[int] = mapped_column(BigInteger, default=0)
    overcommit_confirmed_serial: Mapped[int] = mapped_column(BigInteger, default=0)


class ClusterSetting(Base):
    """Versioned cluster-wide settings, e.g. ``overcommit_default``."""

    __tablename__ = "cluster_settings"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[dict[str, Any]]
    version: Mapped[int] = mapped_column(BigInteger, default=1)
    updated_at: Mapped[datetime]


class Command(Base):
    """The command journal: a write's command ID and the result it produced.

    Replaying the ID with the same input returns `result` (or `error`) as stored; the
    same ID with another input is refused.  Scoped by the calling identity's kind so an
    operator and a node cannot collide."""

    __tablename__ = "commands"

    command_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    operation: Mapped[str] = mapped_column(String(64))
    input_digest: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))  # succeeded|failed
    result: Mapped[dict[str, Any] | None]
    error: Mapped[dict[str, Any] | None]
    identity_id: Mapped[str | None] = mapped_column(String(40))
    created_at: Mapped[datetime]


class Event(Base):
    """An append-only log of what ctrl decided and why (transitions, isolate, retire)."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime]
    subject: Mapped[str] = mapped_column(String(80), index=True)
    kind: Mapped[str] = mapped_column(String(64))
    detail: Mapped[dict[str, Any] | None]
    text: Mapped[str | None] = mapped_column(Text)


class Template(Base):
    """A Template: a root file system image on a Platform (kernel + initramfs), each a
    blob in ctrl's artifact store named by its ``sha256:<hex>`` digest.

    `revision` starts at 1 and grows by one whenever a ``PUT`` changes what the name
    points at; a ``PUT`` of the same blobs changes nothing.  `source` is what the
    builder said about the inputs (recipe, suite, kernel release), for people."""

    __tablename__ = "templates"

    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    image_digest: Mapped[str] = mapped_column(String(71))
    image_size: Mapped[int] = mapped_column(BigInteger)
    kernel_digest: Mapped[str] = mapped_column(String(71))
    initramfs_digest: Mapped[str] = mapped_column(String(71))
    source: Mapped[dict[str, Any] | None]
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    revision: Mapped[int] = mapped_column(BigInteger, default=1)


# ------------------------------------------------------------------ Workspaces (issue 3)


class Workspace(Base):
    """A Workspace: a Template, a retained layer, resources, labels and a lifecycle.

    `revision` is its expected revision: every transition bumps it.  `node_id` and
    `current_instance_id` are set while the Workspace executes (its current Instance
    holds an unreleased Allocation) and NULL otherwise, so "which Workspaces run on
    node N / as Instance I" is one indexed lookup.  The Template's digests are copied
    at create: the retained layer is an overlay on that exact image, so a later change
    of what the Template name points at must not change the Workspace's lower layer."""

    __tablename__ = "workspaces"

    workspace_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    template_name: Mapped[str] = mapped_column(String(63))
    image_digest: Mapped[str] = mapped_column(String(71))
    kernel_digest: Mapped[str] = mapped_column(String(71))
    initramfs_digest: Mapped[str] = mapped_column(String(71))
    labels: Mapped[dict[str, Any]]
    state: Mapped[str] = mapped_column(String(16), index=True)
    reason: Mapped[str | None] = mapped_column(Text)
    revision: Mapped[int] = mapped_column(BigInteger, default=1)
    cpu_millis: Mapped[int] = mapped_column(BigInteger)
    memory_bytes: Mapped[int] = mapped_column(BigInteger)
    layer_size_bytes: Mapped[int] = mapped_column(BigInteger)
    layer_pool_id: Mapped[str] = mapped_column(String(63))
    layer_ref: Mapped[str] = mapped_column(String(32))
    current_instance_id: Mapped[str | None] = mapped_column(String(40), index=True)
    node_id: Mapped[str | None] = mapped_column(String(63), index=True)
    last_instance_id: Mapped[str | None] = mapped_column(String(40))
    last_node_id: Mapped[str | None] = mapped_column(String(63))
    stop_force: Mapped[bool] = mapped_column(Boolean, default=False)
    #: How the writable layer last changed hands (`kibotos.ctrl.pools.handoffs`): CLEAN,
    #: UNKNOWN (opened without the previous holder's release receipt), NULL before any.
    layer_handoff: Mapped[str | None] = mapped_column(String(16))
    #: The operator's network policy (``{public_egress, allow_out, deny_out, egress,
    #: resolver}``, Egress and Resolver by name); NULL = the deployment default
    #: (whatever network its node provides; docs/network.md, "The policy in ctrl").
    network_policy: Mapped[dict[str, Any] | None]
    #: Orders the policy's changes: 1 at create, +1 with every ``set-network``.
    network_revision: Mapped[int] = mapped_column(BigInteger, default=1)
    #: The policy's Egress and Resolver names, indexed: a delete of either is refused
    #: while a Workspace that is not DELETED names it.
    network_egress: Mapped[str | None] = mapped_column(String(63), index=True)
    network_resolver: Mapped[str | None] = mapped_column(String(63), index=True)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    deleted_at: Mapped[datetime | None]

    #: A create sums the reservations of one pool (`kibotos.ctrl.pools.capacity`): this
    #: index keeps that sum to the pool's own Workspaces.
    __table_args__ = (Index("ix_workspaces_layer_pool_state", "layer_pool_id", "state"),)


class WorkspaceLabel(Base):
    """One label of a Workspace, so ``--label k=v`` filters with an index instead of
    scanning JSON (the `labels` column keeps the whole map for rendering)."""

    __tablename__ = "workspace_labels"

    workspace_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    key: Mapped[str] = mapped_column(String(63), primary_key=True)
    value: Mapped[str] = mapped_column(String(63))

    __table_args__ = (Index("ix_workspace_labels_key_value", "key", "value"),)


class Instance(Base):
    """One start of a Workspace on one node, in the node's terms (CREATING, RUNNING,
    STOPPING, STOPPED, FAILED, DESTROYED).  The three cleanup items are what
    ``cleanup-status`` shows: IN_USE, PENDING, RELEASED or UNKNOWN, with who observed
    it (``node`` or ``control_plane``) and when."""

    __tablename__ = "instances"

    instance_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    workspace_id: Mapped[str] = mapped_column(String(40), index=True)
    node_id: Mapped[str] = mapped_column(String(63), index=True)
    state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    cpu_millis: Mapped[int] = mapped_column(BigInteger)
    memory_bytes: Mapped[int] = mapped_column(BigInteger)
    guest: Mapped[dict[str, Any] | None]
    confirmed_on_disk: Mapped[bool | None] = mapped_column(Boolean)
    runtime_status: Mapped[str] = mapped_column(String(16))
    attachment_status: Mapped[str] = mapped_column(String(16))
    residual_status: Mapped[str] = mapped_column(String(16))
    cleanup_source: Mapped[str] = mapped_column(String(16))
    cleanup_at: Mapped[datetime]
    #: A stuck release on the node: since when, and what it still holds
    #: (``[{item, part}]``); NULL when none is pending.
    cleanup_pending_since: Mapped[datetime | None]
    cleanup_held: Mapped[list[Any] | None] = mapped_column(JSON)
    #: When ctrl stored the cleanup result from the node's record of the ended Instance
    #: (then had the node delete the record), or decided it was unknown.
    cleanup_stored_at: Mapped[datetime | None]
    #: The network policy in force on the node, as sent (``instance.create``'s
    #: ``network``, then each ``instance.set_network``; Egress and Resolver by name and
    #: revision, never a secret); NULL: the Instance has no network.
    network: Mapped[dict[str, Any] | None]
    network_revision: Mapped[int | None] = mapped_column(BigInteger)
    #: The guest's addresses as its node last reported them (CIDR text); NULL: not said.
    addresses: Mapped[list[Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    ended_at: Mapped[datetime | None]


class Allocation(Base):
    """CPU and memory one Instance holds on its node until `released_at`.  Placement
    subtracts the unreleased ones from the node's schedulable amount."""

    __tablename__ = "allocations"

    instance_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    node_id: Mapped[str] = mapped_column(String(63))
    workspace_id: Mapped[str] = mapped_column(String(40))
    cpu_millis: Mapped[int] = mapped_column(BigInteger)
    memory_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime]
    released_at: Mapped[datetime | None]

    __table_args__ = (Index("ix_allocations_node_released", "node_id", "released_at"),)


class UseRight(Base):
    """Who may open one pool object (a retained layer or a Volume), at which epoch.

    `holder_node_id` NULL means nobody holds it (a normal stop in a shared pool, or an
    isolate).  The epoch grows when the object is granted to a node other than the last
    holder, or granted again after an isolate released it (`bump_on_grant`)."""

    __tablename__ = "use_rights"

    object_kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    object_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    workspace_id: Mapped[str] = mapped_column(String(40), index=True)
    pool_id: Mapped[str] = mapped_column(String(63))
    pool_shared: Mapped[bool] = mapped_column(Boolean, default=False)
    holder_node_id: Mapped[str | None] = mapped_column(String(63), index=True)
    last_holder_node_id: Mapped[str | None] = mapped_column(String(63))
    epoch: Mapped[int] = mapped_column(BigInteger, default=0)
    bump_on_grant: Mapped[bool] = mapped_column(Boolean, default=False)
    updated_at: Mapped[datetime]


# ------------------------------------------------------------------ Storage pools (issue 4)


class StoragePool(Base):
    """What ctrl remembers about one storage pool ID, beyond the per-node facts.

    Nodes declare pools in their configuration; ctrl makes a row the first time a node
    reports a pool ID (`kibotos.ctrl.pools.facts`), so the operator's settings have a
    home.  `capacity_bytes` is set only by the operator (``kibo storage-pool
    set-capacity``; NULL = not set, and creating an object in the pool is then
    ``resource_exhausted``).  `instance` is the marker instance ctrl registered for the
    ID (the storage itself) and `registered_node_id` the node that registered it; a
    node that is retired or revoked stops holding it, so the same storage declared on
    another host moves the registration there.  `lost_at` is set by ``declare-lost``
    (the storage is gone for good, with `lost_instance` the instance declared lost).
    `revision` is the expected revision of the writes on this row."""

    __tablename__ = "storage_pools"

    pool_id: Mapped[str] = mapped_column(String(63), primary_key=True)
    capacity_bytes: Mapped[int | None] = mapped_column(BigInteger)
    instance: Mapped[str | None] = mapped_column(String(64))
    registered_node_id: Mapped[str | None] = mapped_column(String(63))
    lost_at: Mapped[datetime | None]
    lost_instance: Mapped[str | None] = mapped_column(String(64))
    revision: Mapped[int] = mapped_column(BigInteger, default=1)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


# ------------------------------------------------------------------ Volumes (issue 4)


class Volume(Base):
    """A Volume: a block file of `capacity_bytes` in one storage pool, attached to at
    most one Workspace (`workspace_id`, mounted in the guest at `mount_point`).

    Who may open it, and at which epoch, is its `use_rights` row (kind ``volume``),
    whose `workspace_id` is the attached Workspace ('' while detached), so a start
    finds the Volumes with the writable layer.  `revision` is its expected revision;
    every change bumps it.  A deleted Volume keeps its row (state DELETED)."""

    __tablename__ = "volumes"

    volume_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    pool_id: Mapped[str] = mapped_column(String(63), index=True)
    capacity_bytes: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16), index=True)
    reason: Mapped[str | None] = mapped_column(Text)
    labels: Mapped[dict[str, Any]]
    workspace_id: Mapped[str | None] = mapped_column(String(40), index=True)
    mount_point: Mapped[str | None] = mapped_column(Text)
    #: As `Workspace.layer_handoff`, for this Volume.
    handoff: Mapped[str | None] = mapped_column(String(16))
    revision: Mapped[int] = mapped_column(BigInteger, default=1)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    deleted_at: Mapped[datetime | None]


class ObjectOperation(Base):
    """A long operation on one pool object (a Volume or a writable layer): ``expand``
    to `target_capacity_bytes`, or ``move`` to `target_pool_id`.  While its `status`
    is ``running`` (or ``cleanup``: a move whose old copy is still to be deleted) the
    object's Workspace cannot start; a ``failed`` row stays to say why and, for an
    expansion, the target the next one may not go below (spec: storage-pools-on-nfs,
    "Troubleshooting").  Recorded first, finished by a background task, so it resumes
    after a ctrl restart."""

    __tablename__ = "object_operations"

    object_kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    object_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    workspace_id: Mapped[str | None] = mapped_column(String(40), index=True)
    op: Mapped[str] = mapped_column(String(16))  # expand | move
    status: Mapped[str] = mapped_column(String(16), index=True)  # running|cleanup|failed
    pool_id: Mapped[str] = mapped_column(String(63))
    capacity_bytes: Mapped[int] = mapped_column(BigInteger)
    target_pool_id: Mapped[str | None] = mapped_column(String(63))
    target_capacity_bytes: Mapped[int | None] = mapped_column(BigInteger)
    node_id: Mapped[str | None] = mapped_column(String(63))
    epoch: Mapped[int | None] = mapped_column(BigInteger)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


# ------------------------------------------------------------------ Network (issue 11)


class Egress(Base):
    """An Egress: a caller's SOCKS5 endpoint a Workspace's TCP goes through, by name.

    `revision` starts at 1 and grows with every change; each revision's address,
    username and sealed password are an `EgressRevision` row, so a node running an
    Instance that was sent an older revision can still fetch that one's credentials.
    The password is never in this row (list and get read only this table)."""

    __tablename__ = "egresses"

    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    address: Mapped[str] = mapped_column(String(255))
    username: Mapped[str | None] = mapped_column(String(255))
    revision: Mapped[int] = mapped_column(BigInteger, default=1)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class EgressRevision(Base):
    """One revision of an Egress as nodes receive it.  `password_sealed` is the password
    encrypted with ctrl's egress key (`kibotos.ctrl.store.secret_box`), bound to the
    name and revision; NULL without credentials.  Revisions no live Instance references
    are deleted when a newer one is made."""

    __tablename__ = "egress_revisions"

    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    revision: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    address: Mapped[str] = mapped_column(String(255))
    username: Mapped[str | None] = mapped_column(String(255))
    password_sealed: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime]


class Resolver(Base):
    """A Resolver: the DNS upstream of the Workspaces that name it, reached directly or
    through the Egress `via_egress` (which their policy must then name too)."""

    __tablename__ = "resolvers"

    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    upstream: Mapped[str] = mapped_column(String(255))
    via_egress: Mapped[str | None] = mapped_column(String(63), index=True)
    revision: Mapped[int] = mapped_column(BigInteger, default=1)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class ApiKey(Base):
    """An API key a gateway's callers present (docs/gateways.md): it belongs to a team,
    and a gateway shows a key only its own team's Workspaces.  Only sha256(secret) is
    kept; the key itself is shown once, when it is created."""

    __tablename__ = "api_keys"

    key_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(63))
    team: Mapped[str] = mapped_column(String(63), index=True)
    secret_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime]
    created_by: Mapped[str | None] = mapped_column(String(40))
    revoked_at: Mapped[datetime | None]


class CtrlReplica(Base):
    """A running ctrl process sharing this store (docs/replicas.md).  Its heartbeat is
    the database's clock; a row whose heartbeat is older than the session timeout is a
    replica that is gone, whose node sessions are ended and whose row is deleted."""

    __tablename__ = "ctrl_replicas"

    replica_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    listen: Mapped[str] = mapped_column(String(255))
    started_at: Mapped[datetime]
    heartbeat_at: Mapped[datetime]


class CtrlLease(Base):
    """The singleton lease: which replica runs the singleton work until `expires_at`
    (the database's clock).  `token` grows by one at every change of holder: the
    fencing token that the holder's writes check, so a holder that stalled past its
    expiry cannot write after another took over."""

    __tablename__ = "ctrl_lease"

    name: Mapped[str] = mapped_column(String(40), primary_key=True)
    holder: Mapped[str | None] = mapped_column(String(40))
    token: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[datetime | None]


class RelayedCommand(Base):
    """A node command sent through a replica that does not hold the node's session,
    waiting for the replica that does (`kibotos.ctrl.store.relay_queue`).  `state`:
    ``queued`` → ``taken`` (the holder sent it) → ``done`` (`result` or `error` set).
    The sender deletes the row once it has read the outcome or given up."""

    __tablename__ = "relayed_commands"

    relay_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    node_id: Mapped[str] = mapped_column(String(63))
    replica_id: Mapped[str] = mapped_column(String(40), index=True)
    kind: Mapped[str] = mapped_column(String(64))
    args: Mapped[dict[str, Any]]
    timeout_s: Mapped[float]
    state: Mapped[str] = mapped_column(String(16))
    result: Mapped[dict[str, Any] | None]
    error: Mapped[dict[str, Any] | None]
    created_at: Mapped[datetime]


R = TypeVar("R", bound=Base)


def existing(session: Session, table: type[R], key: str, what: str, detail: str, *,
             for_update: bool = False) -> R:
    """The row of `table` under primary `key`; an unknown one is `NotFound`, said the
    same way for every kind of record (``<what> <key> does not exist``, the key under
    `detail` in the error's details)."""
    row = session.get(table, key, with_for_update=for_update)
    if row is None:
        raise NotFound(f"{what} {key} does not exist", details={detail: key})
    return row
