"""``kibo transfer``: export a Volume as a Transfer archive into ctrl's artifact store,
and import such an archive as a new Volume in any pool (docs/storage.md, "Transfer").

Both wait for the node doing the work: ctrl answers when the archive is stored, or the
imported Volume is AVAILABLE, which for a large Volume takes minutes.  Each request may
therefore take up to `TRANSFER_WAIT` (the global ``--timeout`` still ends the command,
exit 16).  A retry with the same ``--command-id`` replays the stored result; an import
retried after a lost answer lands on the same Volume.  Every argument is checked before
the config is read or anything is sent.
"""

from __future__ import annotations

from typing import Any

import click

from kibotos.cli.core.options import (
    Invocation,
    check_command_id,
    command_id_option,
    kibo_options,
    new_volume_fields,
    new_volume_options,
)
from kibotos.cli.core.output import Section
from kibotos.core import ids
from kibotos.core.units import format_bytes

#: One export or import request may run this long on ctrl (its own limit is 6 h).
TRANSFER_WAIT = 6 * 3600.0 + 60.0


@click.group("transfer")
def transfer_group() -> None:
    """Export Volumes as Transfer archives and import them elsewhere."""


def _client(inv: Invocation) -> Any:
    client = inv.client()
    client.request_timeout = max(client.request_timeout, TRANSFER_WAIT)
    return client


def _size(value: Any) -> str:
    return format_bytes(value) if isinstance(value, int) else "-"


@transfer_group.command("export")
@click.argument("volume_id", metavar="VOLUME")
@command_id_option
@kibo_options
def export(inv: Invocation, volume_id: str, command_id: str | None) -> None:
    """Export a Volume (its Workspace stopped) into ctrl's artifact store; prints the
    archive's digest, which `kibo transfer import` takes."""
    body = {"volume_id": ids.check_object_id(volume_id, "volume ID"),
            "command_id": check_command_id(command_id)}
    out = _client(inv).post("/v1/transfers/export", body)
    if inv.as_json:
        inv.out.json_result(out)
        return
    section = Section(f"Transfer archive of volume {out.get('volume_id')}")
    section.add("Digest", str(out.get("artifact_digest")))
    section.add("Archive size", _size(out.get("size")))
    section.add("Capacity", _size(out.get("capacity_bytes")))
    section.add("Pool", str(out.get("pool_id")))
    section.add("Exported by", f"node {out.get('node_id')} at epoch {out.get('epoch')}")
    inv.out.sections([section])


@transfer_group.command("import")
@click.argument("digest", metavar="DIGEST")
@new_volume_options
@command_id_option
@kibo_options
def import_(inv: Invocation, digest: str, pool_id: str | None, label_items: tuple[str, ...],
            command_id: str | None) -> None:
    """Import a Transfer archive (by its digest) as a new Volume; prints the Volume."""
    from kibotos.cli.workspace.volume_cmds import summary
    body = {"artifact_digest": ids.check_digest(digest),
            **new_volume_fields(pool_id, label_items),
            "command_id": check_command_id(command_id)}
    out = _client(inv).post("/v1/transfers/import", body)
    if inv.as_json:
        inv.out.json_result(out)
        return
    volume = out.get("volume") if isinstance(out.get("volume"), dict) else {}
    inv.out.line(f"{summary(volume)}; imported from {out.get('artifact_digest')} (volume "
                 f"{out.get('source_volume_id')}) by node {out.get('node_id')}")
