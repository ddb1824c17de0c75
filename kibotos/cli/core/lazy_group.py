"""A click group whose commands are imported when they are used.

``kibo`` runs one command per process, and each command's module may need libraries
the others do not (exec its WebSocket client, cp the data plane's file client), so a group
names its commands as ``"module:attribute"`` and imports only the one click asks for.
Listing the group (``--help``, completion) imports them all, which is fine there.
"""

from __future__ import annotations

import importlib
from typing import Any

import click


class LazyGroup(click.Group):
    """`lazy` maps a command name to the ``"module:attribute"`` of its click command."""

    def __init__(self, *args: Any, lazy: dict[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self._lazy))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self._lazy:
            module, _, attr = self._lazy[cmd_name].partition(":")
            cmd = getattr(importlib.import_module(module), attr)
            assert isinstance(cmd, click.Command)
            return cmd
        return super().get_command(ctx, cmd_name)
