"""The non-ID value types of the protocol: times, sizes, counters and short texts.

Each has one rule and a ceiling.  Integers are bounded because a peer that sends a
number far outside any real value (a memory size of 2**80, a negative epoch) is broken
or hostile, and the sooner it is refused, naming the field, the less of it reaches the
store, a file name or a VMM's command line.
"""

from __future__ import annotations

from datetime import datetime
from enum import Enum
from typing import Annotated, TypeVar

from pydantic import AfterValidator, Field, StrictInt, StrictStr

from kibotos.core import units
from kibotos.core.control_chars import CONTROL_CHARACTERS, PRINTABLE_TEXT, escape_controls
from kibotos.core.errors import InvalidArgument
from kibotos.protocol.ids import SchemaPattern

MIB = 1 << 20
#: The largest integer both ends of a JSON exchange represent exactly (a double's
#: 53-bit mantissa): the ceiling of every counter (epochs, serials, request IDs).
MAX_COUNTER = (1 << 53) - 1
#: Memory of one Instance: at least what every VMM backend boots (`kibotos.vmm_launch`),
#: at most 16 TiB.
MIN_INSTANCE_MEMORY = 64 * MIB
MAX_INSTANCE_MEMORY = 1 << 44
#: CPU of one Instance, in thousandths of a core (ctrl's ``cpu_millis`` ceiling).
MAX_INSTANCE_CPU_MILLIS = 1_000_000
#: A block file (writable layer, Volume): at most 1 PiB.
MAX_CAPACITY = 1 << 50
#: A node's resources or allocations (overcommitted up to 16 times): generous ceilings.
MAX_NODE_CPU_MILLIS = 1_000_000_000
MAX_NODE_MEMORY = 1 << 56
#: Instance and object counts a node reports.
MAX_COUNT = 1_000_000
#: The longest free text (a reason, a held part) a frame carries; a sender cuts longer
#: texts to it (`clip`).
MAX_REASON = 4000
#: The longest error message a ``command_result`` carries.
MAX_ERROR_MESSAGE = 16000


_E = TypeVar("_E", bound=Enum)
#: An enum field read from parsed JSON: the wire text of a member is accepted (strict
#: mode alone would want the member itself), anything else is refused, a number too.
WireEnum = Annotated[_E, Field(strict=False)]


def _printable(value: str) -> str:
    found = CONTROL_CHARACTERS.search(value)
    if found:
        raise ValueError(f"must not contain control characters (found U+{ord(found.group()):04X}"
                         f" at offset {found.start()})")
    return value


def parse_rfc3339(value: str) -> datetime:
    """An RFC 3339 time (``Z`` or an offset): one reading for every side of the wire.
    Refused with `ValueError` whose text is the reason alone (``is not an RFC 3339
    time``, ``has no time zone``), for the caller to word with the field's name."""
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError("is not an RFC 3339 time") from None
    if parsed.tzinfo is None:
        raise ValueError("has no time zone")
    return parsed


def _rfc3339(value: str) -> str:
    try:
        parse_rfc3339(value)
    except ValueError as exc:
        raise ValueError(f"{value!r} {exc}") from None
    return value


def _whole_mib(value: int) -> int:
    if value % MIB:
        raise ValueError("must be a whole number of MiB")
    return value


def _mib_range(low: int, high: int) -> AfterValidator:
    """A size in ``[low, high]`` and a whole number of MiB, said in MiB."""

    def check(value: int) -> int:
        if value < low:
            raise ValueError(f"must be at least {low // MIB} MiB")
        if value > high:
            raise ValueError(f"must be at most {high // MIB} MiB")
        return _whole_mib(value)

    return AfterValidator(check)


def _ratio(value: str) -> str:
    try:
        units.parse_ratio(value)
    except InvalidArgument as exc:
        raise ValueError(exc.message) from None
    return value


#: An RFC 3339 time with its zone, kept as sent (``2026-01-01T00:00:00Z``).
Timestamp = Annotated[StrictStr, Field(max_length=64), AfterValidator(_rfc3339)]
#: Epochs of use rights (0 is the epoch of an object no ctrl granted yet).
Epoch = Annotated[StrictInt, Field(ge=0, le=MAX_COUNTER)]
#: Request IDs of ``clock_probe``, ``usage_request`` and ``command`` (from 1).
RequestId = Annotated[StrictInt, Field(ge=1, le=MAX_COUNTER)]
Serial = Annotated[StrictInt, Field(ge=0, le=MAX_COUNTER)]
Count = Annotated[StrictInt, Field(ge=0, le=MAX_COUNT)]
#: Revisions of versioned records (an Egress, a Resolver, a network policy), from 1.
Revision = Annotated[StrictInt, Field(ge=1, le=MAX_COUNTER)]
InstanceCpuMillis = Annotated[StrictInt, Field(ge=1, le=MAX_INSTANCE_CPU_MILLIS)]
InstanceMemory = Annotated[StrictInt, _mib_range(MIN_INSTANCE_MEMORY, MAX_INSTANCE_MEMORY)]
#: The size of a block file: a whole number of MiB.  ctrl's API asks for at least
#: 64 MiB; the node can make smaller ones (its tests do), so the wire does not.
Capacity = Annotated[StrictInt, _mib_range(MIB, MAX_CAPACITY)]
NodeCpuMillis = Annotated[StrictInt, Field(ge=0, le=MAX_NODE_CPU_MILLIS)]
NodeMemory = Annotated[StrictInt, Field(ge=0, le=MAX_NODE_MEMORY)]
#: An overcommit ratio as a decimal string (``"1.5"``), 0-16, three decimals at most.
Ratio = Annotated[StrictStr, Field(max_length=16), AfterValidator(_ratio)]
#: Text without control characters: identifiers, versions, addresses and names, which
#: are shown to people and written into logs as they are.
#: (`NoControl` is the check alone, to follow a length in an ``Annotated``: pydantic
#: then reports a long string as a string.)
NoControl = AfterValidator(_printable)
#: `NoControl` in a field's JSON schema (ctrl's OpenAPI document).
NO_CONTROL_PATTERN = SchemaPattern(PRINTABLE_TEXT)
Printable = Annotated[StrictStr, NoControl, NO_CONTROL_PATTERN]
#: Free text from the other side (a reason, an error message): bounded, never parsed,
#: and printable like every text that reaches a table or a log line; a sender writes
#: its control characters as escapes (`clip`, `printable_text`).
Reason = Annotated[StrictStr, Field(max_length=MAX_REASON), NoControl, NO_CONTROL_PATTERN]


def printable_text(text: str, limit: int) -> str:
    """`text` as a sender puts it into a free-text field: its control characters
    written as escapes (a QEMU error's newlines become ``\\x0a``), then cut to
    `limit` characters."""
    text = escape_controls(text)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def clip(text: str | None) -> str | None:
    """`text` fit for a `Reason`: printable (`printable_text`) and cut to `MAX_REASON`
    characters, for a sender whose reason comes from an error message of unknown
    length and content."""
    return None if text is None else printable_text(text, MAX_REASON)
