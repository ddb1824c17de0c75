"""What every node command's arguments share, and how a bad one is refused.

ctrl builds the arguments as one of these classes and sends ``to_wire()``; the node
parses what arrives with the same class (`parse_args`).  Arguments refuse fields they
do not know, so a contract drift between ctrl and a node shows up at the first command
instead of as an instruction silently dropped; types are strict (``"1"`` is not 1,
``true`` is not 1); a bad argument is `invalid_argument` naming the field.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from kibotos.core.errors import InvalidArgument
from kibotos.protocol.codec import describe


class Args(BaseModel):
    """The arguments of one command; `KIND` is the command's name."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    KIND: ClassVar[str]

    def to_wire(self) -> dict[str, Any]:
        """The ``args`` object of the ``command`` frame (every field, defaults too)."""
        return self.model_dump(mode="json")


class Part(BaseModel):
    """A nested part of a command's arguments (the Template of a create …)."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")


_A = TypeVar("_A", bound=Args)


def parse_args(model: type[_A], args: object, kind: str | None = None) -> _A:
    """`args` as `model`, or `InvalidArgument` ``<kind>: <field>: <what is wrong>``."""
    kind = kind or model.KIND
    if not isinstance(args, dict):
        raise InvalidArgument(f"{kind}: args must be an object")
    try:
        return model.model_validate(args)
    except ValidationError as exc:
        raise InvalidArgument(f"{kind}: {describe(exc)}") from None
