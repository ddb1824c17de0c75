"""The nested shapes of the session's frames: resource amounts, what an Instance holds
and how it came by it, its guest, a stuck release, a command's error.

Like the frames themselves (`kibotos.protocol.messages`) they ignore fields they do not
know, so a newer peer can add one without breaking an older one; a known field of the
wrong type or shape is refused.  `GuestFacts` keeps unknown fields: ctrl stores and
shows the guest facts as the node sent them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    ValidationError,
)

from kibotos.core.control_chars import escape_controls
from kibotos.protocol.ids import InstanceId, ObjectId, PoolId, WorkspaceId
from kibotos.protocol.states import CleanupItem, HeldKind, InstanceStatus
from kibotos.protocol.values import (
    MAX_COUNT,
    MAX_ERROR_MESSAGE,
    Count,
    Epoch,
    NoControl,
    NodeCpuMillis,
    NodeMemory,
    Reason,
    Timestamp,
    WireEnum,
)


class Part(BaseModel):
    """Base of every frame and frame part: strict types, unknown fields ignored."""

    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")

    def to_wire(self) -> dict[str, Any]:
        """The JSON object of this part as it was given (fields left out stay out)."""
        return self.model_dump(mode="json", exclude_unset=True)


class Amount(Part):
    """CPU in thousandths of a core and memory in bytes (``resources``, ``allocated``)."""

    cpu_millis: NodeCpuMillis
    memory_bytes: NodeMemory


class HeldObject(Part):
    """One object an Instance opened and how the handoff went (``objects[]``):
    `released_cleanly` is true after the previous holder's clean release or receipt,
    false when the receipt wait ended without one, null for no handoff."""

    kind: WireEnum[HeldKind]
    pool_id: PoolId
    object_id: ObjectId
    epoch: Epoch
    released_cleanly: StrictBool | None = None


HeldObjects = Annotated[list[HeldObject], Field(max_length=64)]


class InstanceSummary(Part):
    """One Instance as ``hello``/``report`` list it, so ctrl reconciles after a
    reconnect."""

    instance_id: InstanceId
    workspace_id: WorkspaceId
    state: WireEnum[InstanceStatus]
    reason: Reason | None = None
    #: Absent from older nodes.
    objects: HeldObjects | None = None


GUEST_TEXT = 128
GUEST_CAPABILITIES = 256


class GuestFacts(Part):
    """What the node says of a RUNNING Instance's guest (``instance_state.guest``):
    `responding` is false for an adopted Instance until its guest is configured again."""

    model_config = ConfigDict(strict=True, frozen=True, extra="allow")

    boot_id: Annotated[StrictStr, Field(max_length=GUEST_TEXT), NoControl] | None = None
    capabilities: Annotated[list[Annotated[StrictStr, Field(max_length=GUEST_TEXT), NoControl]],
                            Field(max_length=GUEST_CAPABILITIES)] = Field(default_factory=list)
    responding: StrictBool | None = None

    @classmethod
    def from_guest(cls, facts: Mapping[str, Any]) -> GuestFacts:
        """The guest facts a node sends, from what it gathered from the guest (which it
        does not trust): what fits its shape, texts printable and cut to their ceiling;
        what does not fit (a number for a boot ID, a list for a version, a capability
        that is not a short printable name) is left out."""
        out: dict[str, Any] = {}
        for key, value in facts.items():
            if key == "capabilities":
                if isinstance(value, list | tuple):
                    out[key] = [c for c in value if isinstance(c, str)
                                and len(c) <= GUEST_TEXT
                                and escape_controls(c) == c][:GUEST_CAPABILITIES]
            elif key == "responding":
                if isinstance(value, bool):
                    out[key] = value
            elif isinstance(value, str):
                out[key] = escape_controls(value)[:GUEST_TEXT]
            elif value is None or (isinstance(value, int | float) and key != "boot_id"):
                out[key] = value
        return cls.model_validate(out)


class HeldPart(Part):
    """One thing a stuck release still holds: the cleanup item and what it is."""

    item: WireEnum[CleanupItem]
    part: Reason


class CleanupPending(Part):
    """``instance_state.cleanup`` of a STOPPING Instance whose release is stuck."""

    pending_since: Timestamp
    held: Annotated[list[HeldPart], Field(max_length=256)] = Field(default_factory=list)


class CommandError(Part):
    """``command_result.error``: ``{code, message, details?}`` as in the HTTP API."""

    code: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    message: Annotated[StrictStr, Field(max_length=MAX_ERROR_MESSAGE), NoControl]
    details: dict[str, Any] | None = None


class NetworkFacts(Part):
    """``facts.network`` of ``hello`` and ``report``: the node gives its Instances a
    network (it has ``[network]``), and whether it provides public egress.  Absent or
    null: no network at all (also every node from before networking)."""

    public_egress: StrictBool = False


def check_facts(facts: dict[str, Any]) -> dict[str, Any]:
    """The facts of a ``hello`` or ``report``: free-form for what ctrl only stores, but
    a ``network`` fact must have its shape (placement reads it), kept in full form."""
    network = facts.get("network")
    if network is None:
        return facts
    try:
        checked = NetworkFacts.model_validate(network)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in ("network", *first["loc"]))
        raise ValueError(f"{where}: {first['msg']}") from None
    return {**facts, "network": checked.model_dump(mode="json")}


Facts = Annotated[dict[str, Any], AfterValidator(check_facts)]


class ReportFields(Part):
    """The full report: ``hello.report`` and the fields of every ``report``."""

    allocated: Amount = Field(default_factory=lambda: Amount(cpu_millis=0, memory_bytes=0))
    instance_count: Count = 0
    volume_count: Count = 0
    memory_tight: StrictBool = False
    memory_tight_since: Timestamp | None = None
    #: Every Instance on the node; None from a node that does not say.
    instances: Annotated[list[InstanceSummary], Field(max_length=MAX_COUNT)] | None = None
    #: In a ``report``: the facts that change while a session lives (``pools`` with
    #: their availability), stored over hello's; None from a node that does not say.
    facts: Facts | None = None
