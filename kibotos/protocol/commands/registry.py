"""The records a node keeps of its ended Instances, collected by ctrl
(``registry.list``, then ``registry.delete`` once ctrl stored their cleanup result)."""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field, StrictInt

from kibotos.protocol.commands.base import Args
from kibotos.protocol.ids import InstanceId

#: At most this many records per call (spec: ctrl handles at most 100 records per node
#: each time).
LIST_LIMIT = 100


class RegistryListArgs(Args):
    """The oldest `limit` records, and whether more exist."""

    KIND: ClassVar[str] = "registry.list"

    limit: Annotated[StrictInt, Field(ge=1, le=LIST_LIMIT)] = LIST_LIMIT


class RegistryDeleteArgs(Args):
    """Delete these records; answers the IDs that had one."""

    KIND: ClassVar[str] = "registry.delete"

    instance_ids: Annotated[list[InstanceId], Field(max_length=LIST_LIMIT)]
