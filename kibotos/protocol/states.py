"""The closed vocabularies of the session, as `str` enums.

They are `StrEnum`s so a member *is* its wire text: ``InstanceStatus.RUNNING ==
"RUNNING"``, it serialises as ``"RUNNING"``, and code that stores or compares the plain
strings (ctrl's store columns, the node's records on disk) keeps working unchanged.
"""

from __future__ import annotations

from enum import StrEnum


class InstanceStatus(StrEnum):
    """The ``state`` of an Instance as its node reports it (docs/architecture.md)."""

    CREATING = "CREATING"
    RUNNING = "RUNNING"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"
    FAILED = "FAILED"
    DESTROYED = "DESTROYED"


#: States in which an Instance still holds its CPU and memory on the node (a FAILED one
#: keeps them until it is destroyed or stopped with force).
HOLDING_STATES = frozenset({InstanceStatus.CREATING, InstanceStatus.RUNNING,
                            InstanceStatus.STOPPING, InstanceStatus.FAILED})
#: States after which nothing of the Instance runs on the node any more.
ENDED_STATES = frozenset({InstanceStatus.STOPPED, InstanceStatus.DESTROYED})


class ObjectKind(StrEnum):
    """The pool objects a storage command names (``kind`` of ``object.*``)."""

    VOLUME = "volume"
    RETAINED_LAYER = "retained_layer"


class HeldKind(StrEnum):
    """The pool directory of an object an Instance opened (``objects[].kind`` of the
    frames and report entries)."""

    RETAINED_LAYERS = "retained-layers"
    VOLUMES = "volumes"


#: A storage command's object kind -> the directory its objects live in.
HELD_KIND_OF = {ObjectKind.VOLUME: HeldKind.VOLUMES,
                ObjectKind.RETAINED_LAYER: HeldKind.RETAINED_LAYERS}


class CleanupItem(StrEnum):
    """What a node releases when an Instance ends (``cleanup-status`` items)."""

    RUNTIME = "RUNTIME"
    VOLUME_ATTACHMENT = "VOLUME_ATTACHMENT"
    RESIDUAL = "RESIDUAL"


class SyncStatus(StrEnum):
    """The node kernel's view of its clock (``clock_reply.sync_status``, `adjtimex`)."""

    SYNCHRONIZED = "synchronized"
    UNSYNCHRONIZED = "unsynchronized"
    UNKNOWN = "unknown"


class RejectReason(StrEnum):
    """``rejected.reason``, checked in this order (docs/architecture.md): a retired
    node is told ``not_admitted`` (``isolated`` while it still uses the isolated
    incarnation), as spec/nodes.txt says."""

    ISOLATED = "isolated"
    NOT_ADMITTED = "not_admitted"
    STALE_INCARNATION = "stale_incarnation"
    INVALID_HELLO = "invalid_hello"


class CloseReason(StrEnum):
    """``close.reason``: why ctrl ends a session."""

    REVOKED = "revoked"
    RETIRED = "retired"
    REPLACED = "replaced"
    OVERCOMMIT_ACK_TIMEOUT = "overcommit_ack_timeout"
    PROTOCOL_ERROR = "protocol_error"
    CTRL_SHUTDOWN = "ctrl_shutdown"
