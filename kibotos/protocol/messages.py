"""The frames of the node control session (docs/architecture.md, "Node control
session"), both ways.

Every frame is one JSON object whose ``type`` names the message, its fields beside it.
ctrl builds the ``ctrl → node`` frames from these classes and parses the ``node →
ctrl`` ones with them; the node does the reverse, so a field has one rule on both
sides.  Frames ignore fields they do not know: nodes and ctrl are upgraded one at a
time, and a newer peer may add a fact an older one has no use for.  (Command arguments
are the opposite: an argument the node does not know would be an instruction silently
dropped, so `kibotos.protocol.commands` refuses it.)
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from kibotos.protocol.ids import InstanceId, NodeId, SessionId, WorkspaceId
from kibotos.protocol.parts import (
    Amount,
    CleanupPending,
    CommandError,
    Facts,
    GuestFacts,
    HeldObjects,
    Part,
    ReportFields,
)
from kibotos.protocol.states import (
    CloseReason,
    InstanceStatus,
    RejectReason,
    SyncStatus,
)
from kibotos.protocol.values import (
    MAX_COUNTER,
    NoControl,
    Ratio,
    Reason,
    RequestId,
    Serial,
    Timestamp,
    WireEnum,
)

#: A release version or source revision: shown in `kibo node list`, so printable.
Version = Annotated[StrictStr, Field(max_length=64), NoControl]


def _interface(value: str) -> str:
    """An address with its prefix (``10.200.0.3/31``), in canonical text."""
    try:
        return str(ipaddress.ip_interface(value))
    except ValueError:
        raise ValueError(f"{value!r} is not an address with a prefix") from None


GuestAddress = Annotated[StrictStr, Field(max_length=64), AfterValidator(_interface)]
GuestAddresses = Annotated[list[GuestAddress], Field(max_length=16)]


class Message(Part):
    """A frame; each class fixes its ``type`` as a one-value `Literal` with that value
    as the default, so ``Ping()`` is a whole frame."""

    def to_wire(self) -> dict[str, Any]:
        """The frame as a JSON object, ``type`` always included."""
        return {"type": self.type_name(), **super().to_wire()}

    @classmethod
    def type_name(cls) -> str:
        default = cls.model_fields["type"].default
        assert isinstance(default, str)
        return default


# ------------------------------------------------------------------ node → ctrl


class Hello(Message):
    """The node's first frame: who it is, what it has, what it holds."""

    type: Literal["hello"] = "hello"
    node_id: NodeId
    incarnation: Annotated[StrictInt, Field(ge=1, le=MAX_COUNTER)]
    release_version: Version | None = None
    source_revision: Version | None = None
    resources: Amount
    report: ReportFields = Field(default_factory=ReportFields)
    #: ``https://host:port`` for a data plane serving TLS, the bare ``host:port`` for
    #: one serving plain HTTP on loopback (`kibotos.protocol.certificates.dataplane_url`).
    dataplane_address: Annotated[StrictStr, Field(max_length=255), NoControl] | None = None
    #: Free-form facts ctrl stores (``pools``, …); ``network`` has a shape
    #: (`NetworkFacts`).
    facts: Facts = Field(default_factory=dict)


class Report(ReportFields, Message):
    """Sent whenever the full report changes (memory tight flips, counts change, a
    pool's availability changes)."""

    type: Literal["report"] = "report"


class InstanceState(Message):
    """Sent whenever an Instance changes state (and, for an adopted Instance, when its
    guest answers again)."""

    type: Literal["instance_state"] = "instance_state"
    instance_id: InstanceId
    workspace_id: WorkspaceId | None = None
    state: WireEnum[InstanceStatus]
    reason: Reason | None = None
    guest: GuestFacts | None = None
    #: A stuck release (STOPPING): what is still held, since when.
    cleanup: CleanupPending | None = None
    #: What it opened and how each came to the node; absent from older nodes.
    objects: HeldObjects | None = None
    #: The guest's addresses (CIDR text, e.g. ``10.200.0.3/31``) once its network is
    #: up; absent from nodes that do not say (ctrl keeps what it was told last).
    addresses: GuestAddresses | None = None
    at: Timestamp | None = None


class ClockReply(Message):
    type: Literal["clock_reply"] = "clock_reply"
    id: RequestId
    #: Unix seconds, read as late as possible before the send.
    node_time: Annotated[StrictFloat, Field(allow_inf_nan=False)]
    sync_status: WireEnum[SyncStatus] = SyncStatus.UNKNOWN


class Usage(Message):
    """The latest host usage sample (docs/architecture.md, "Host usage sample")."""

    type: Literal["usage"] = "usage"
    id: RequestId
    sample: dict[str, Any] | None


class CommandResult(Message):
    """The answer to a ``command``: `result` when `ok`, else `error`."""

    type: Literal["command_result"] = "command_result"
    id: RequestId
    ok: StrictBool
    result: dict[str, Any] | None = None
    error: CommandError | None = None


class OvercommitAck(Message):
    type: Literal["overcommit_ack"] = "overcommit_ack"
    serial: Serial


class Ping(Message):
    """Every 5 s, so ctrl can tell a live session from a dead one."""

    type: Literal["ping"] = "ping"


# ------------------------------------------------------------------ ctrl → node


class Ratios(Part):
    """``welcome.overcommit``: the ratios as decimal strings, and their serial."""

    cpu: Ratio
    memory: Ratio
    serial: Serial


class Welcome(Message):
    """ctrl accepted the hello; the welcome counts as a confirmation of the ratios."""

    type: Literal["welcome"] = "welcome"
    session_id: SessionId
    overcommit: Ratios | None = None
    drain_requested: StrictBool | None = None
    #: The key the node's data plane verifies session credentials with.
    session_signing_public_key: Annotated[StrictStr, Field(max_length=1000)] | None = None


class Rejected(Message):
    """ctrl refused the hello; the socket closes after it."""

    type: Literal["rejected"] = "rejected"
    reason: WireEnum[RejectReason]
    message: Reason = ""


class Close(Message):
    """ctrl ends the session; the socket closes after it."""

    type: Literal["close"] = "close"
    reason: WireEnum[CloseReason]


class ClockProbe(Message):
    type: Literal["clock_probe"] = "clock_probe"
    id: RequestId


class UsageRequest(Message):
    type: Literal["usage_request"] = "usage_request"
    id: RequestId


class Overcommit(Ratios, Message):
    """New ratios; the node acknowledges the serial (``overcommit_ack``)."""

    type: Literal["overcommit"] = "overcommit"


class Command(Message):
    """A node command; `args` are checked by the node against the command's type
    (`kibotos.protocol.commands`), so an unknown kind can be answered by name."""

    type: Literal["command"] = "command"
    id: RequestId
    kind: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    args: dict[str, Any] = Field(default_factory=dict)


class Pong(Message):
    type: Literal["pong"] = "pong"


def _by_type(*classes: type[Message]) -> dict[str, type[Message]]:
    return {cls.type_name(): cls for cls in classes}


#: What a node may send, by ``type``.
NODE_MESSAGES = _by_type(Hello, Report, InstanceState, ClockReply, Usage, CommandResult,
                         OvercommitAck, Ping)
#: What ctrl may send, by ``type``.
CTRL_MESSAGES = _by_type(Welcome, Rejected, Close, ClockProbe, UsageRequest, Overcommit,
                         Command, Pong)
