"""Every node command's arguments, by command name (`COMMANDS`)."""

from __future__ import annotations

from typing import Any

from kibotos.core.errors import InvalidArgument
from kibotos.protocol.commands.base import Args, parse_args
from kibotos.protocol.commands.instances import (
    CreateSpec,
    DestroyArgs,
    DrainArgs,
    LaunchArgs,
    LayerRef,
    StopArgs,
    TemplateRef,
    VolumeRef,
)
from kibotos.protocol.commands.network import (
    EgressRef,
    NetworkPolicy,
    ResolverRef,
    SetNetworkArgs,
)
from kibotos.protocol.commands.registry import LIST_LIMIT, RegistryDeleteArgs, RegistryListArgs
from kibotos.protocol.commands.storage import (
    LayerDeleteArgs,
    ObjectCopyArgs,
    ObjectExpandArgs,
    ObjectExportArgs,
    ObjectImportArgs,
    VolumeCreateArgs,
    VolumeDeleteArgs,
)

#: The arguments' type of every command a node answers, by its name.
COMMANDS: dict[str, type[Args]] = {cls.KIND: cls for cls in (
    CreateSpec, StopArgs, DestroyArgs, DrainArgs, LayerDeleteArgs, VolumeCreateArgs,
    VolumeDeleteArgs, ObjectExpandArgs, ObjectCopyArgs, ObjectExportArgs, ObjectImportArgs,
    RegistryListArgs, RegistryDeleteArgs, SetNetworkArgs)}


def parse_command(kind: str, args: Any) -> Args:
    """`args` of command `kind` as its type; an unknown kind is `invalid_argument`."""
    model = COMMANDS.get(kind)
    if model is None:
        raise InvalidArgument(f"unknown command kind {kind!r}")
    return parse_args(model, args)


__all__ = [
    "COMMANDS",
    "LIST_LIMIT",
    "Args",
    "CreateSpec",
    "DestroyArgs",
    "DrainArgs",
    "EgressRef",
    "LaunchArgs",
    "LayerDeleteArgs",
    "LayerRef",
    "NetworkPolicy",
    "ObjectCopyArgs",
    "ObjectExpandArgs",
    "ObjectExportArgs",
    "ObjectImportArgs",
    "RegistryDeleteArgs",
    "RegistryListArgs",
    "ResolverRef",
    "SetNetworkArgs",
    "StopArgs",
    "TemplateRef",
    "VolumeCreateArgs",
    "VolumeDeleteArgs",
    "VolumeRef",
    "parse_args",
    "parse_command",
]
