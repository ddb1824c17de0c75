"""Tables of ctrl's store (SQLAlchemy 2 declarative).

Every change to a table here comes with an alembic migration in ``migrations/versions``;
`tests/ctrl/test_migrations.py` checks the two agree.  Quantities are exact integers:
CPU in millicores, memory in bytes, ratios in thousandths, times in UTC.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


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
