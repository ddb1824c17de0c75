"""Records of ended Instances and of preparation commands, in
``<storage.root>/runtime/registry/`` (spec: node-and-vmm-processes, "Records of ended
Instances").

* ``<instance_id>.json``: what remains of an Instance that ended here (stopped or
  destroyed): its final state, whether the stop was confirmed on disk, what it
  released, and the cleanup result the node observed (``cleanup{RUNTIME,
  VOLUME_ATTACHMENT, RESIDUAL, observed_at}``, ``observed_at`` being the moment the node
  saw the cleanup finish).  A repeated command about the Instance answers from it.  It
  stays until ctrl has stored the cleanup result and asks for its deletion
  (``registry.list`` / ``registry.delete``, at most `LIST_LIMIT` per call), so ctrl
  never loses what the node saw.
* ``volume-commands.json``: the results of Volume, writable-layer and Template
  preparation commands (``layer.delete`` …), so a repeat gets the same answer; each
  entry is kept `VOLUME_COMMAND_KEEP_S` (24 h), then pruned.

Every write goes through `kibotos.core.atomicfile`; temporary files in this directory are
deleted at node start (`kibotos.node.storage.pools.tempfiles.sweep_local`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import trio

from kibotos.core import atomicfile
from kibotos.core.errors import FailedPrecondition
from kibotos.core.logs import EventLogger
from kibotos.node.instances.contract import CommandHandler
from kibotos.node.records import instance_records as records
from kibotos.protocol import LIST_LIMIT as LIST_LIMIT
from kibotos.protocol import (
    LayerDeleteArgs,
    ObjectCopyArgs,
    ObjectExpandArgs,
    ObjectExportArgs,
    ObjectImportArgs,
    RegistryDeleteArgs,
    RegistryListArgs,
    VolumeCreateArgs,
    VolumeDeleteArgs,
    parse_args,
)

log = EventLogger()

VOLUME_COMMANDS = "volume-commands.json"
VOLUME_COMMAND_KEEP_S = 24 * 3600.0
#: The cleanup items a registry entry reports (ctrl's ``cleanup-status`` items).
ITEMS = ("RUNTIME", "VOLUME_ATTACHMENT", "RESIDUAL")
RELEASED = "RELEASED"


def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


class Registry:
    """The registry directory; every method blocks (call it in a worker thread)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    # ------------------------------------------------------------------ ended Instances

    def read(self, instance_id: str) -> dict[str, Any] | None:
        return records.read_registry_entry(self.dir, instance_id)

    def write(self, instance_id: str, entry: Mapping[str, Any]) -> None:
        records.write_registry_entry(self.dir, instance_id, entry)

    def _record_paths(self) -> list[Path]:
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        return [self.dir / n for n in names
                if n.endswith(".json") and not n.startswith(".") and n != VOLUME_COMMANDS]

    def entries(self, limit: int = LIST_LIMIT) -> tuple[list[dict[str, Any]], bool]:
        """The oldest `limit` records as ctrl sees them, and whether more exist."""
        dated = []
        for path in self._record_paths():
            try:
                dated.append((path.stat().st_mtime, path.name, path))
            except FileNotFoundError:
                continue
        dated.sort()
        entries = []
        for _, name, _path in dated[:limit]:
            entry = self.read(name[:-len(".json")])
            if entry is not None:
                entries.append(wire_entry(entry))
        return entries, len(dated) > limit

    def delete(self, instance_ids: Sequence[str]) -> list[str]:
        """Delete the records ctrl no longer needs; the IDs that had one."""
        deleted = []
        for instance_id in instance_ids:
            try:
                (self.dir / f"{instance_id}.json").unlink()
                deleted.append(instance_id)
            except FileNotFoundError:
                continue
        if deleted:
            atomicfile.fsync_dir(self.dir)
        return deleted

    # ------------------------------------------------------------------ volume commands

    def _read_commands(self) -> list[dict[str, Any]]:
        try:
            value = atomicfile.read_json(self.dir / VOLUME_COMMANDS)
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            raise FailedPrecondition(f"unreadable record {self.dir / VOLUME_COMMANDS}: "
                                     f"{exc}") from None
        entries = value.get("entries") if isinstance(value, dict) else None
        return [e for e in entries or [] if isinstance(e, dict)]

    def _write_commands(self, entries: list[dict[str, Any]]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        atomicfile.write_json(self.dir / VOLUME_COMMANDS,
                              {"format": records.FORMAT, "entries": entries}, mode=0o600)

    @staticmethod
    def _fresh(entries: list[dict[str, Any]], now: datetime) -> list[dict[str, Any]]:
        cutoff = now - timedelta(seconds=VOLUME_COMMAND_KEEP_S)
        return [e for e in entries if (t := _parse_time(e.get("at"))) is not None
                and t > cutoff]

    def record_volume_command(self, kind: str, key: str, result: Mapping[str, Any], *,
                              now: datetime | None = None) -> None:
        """Remember one preparation command's result (replacing an older one of the same
        kind and key) and prune entries older than 24 h."""
        now = now or datetime.now(UTC)
        entries = [e for e in self._fresh(self._read_commands(), now)
                   if not (e.get("kind") == kind and e.get("key") == key)]
        entries.append({"kind": kind, "key": key, "result": dict(result),
                        "at": now.isoformat()})
        self._write_commands(entries)

    def volume_command(self, kind: str, key: str, *, now: datetime | None = None
                       ) -> dict[str, Any] | None:
        """The remembered result of a command of `kind` and `key` younger than 24 h."""
        for entry in self._fresh(self._read_commands(), now or datetime.now(UTC)):
            if entry.get("kind") == kind and entry.get("key") == key:
                result = entry.get("result")
                return dict(result) if isinstance(result, dict) else None
        return None

    def prune_volume_commands(self, *, now: datetime | None = None) -> int:
        """Drop entries older than 24 h; how many went."""
        entries = self._read_commands()
        fresh = self._fresh(entries, now or datetime.now(UTC))
        if len(fresh) != len(entries):
            self._write_commands(fresh)
        return len(entries) - len(fresh)


def cleanup_result(observed_at: str) -> dict[str, Any]:
    """What the node saw when an Instance's cleanup finished: everything released."""
    return {**dict.fromkeys(ITEMS, RELEASED), "observed_at": observed_at}


def wire_entry(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A record as ``registry.list`` returns it (an entry written before the cleanup
    result was recorded reports everything released when it ended)."""
    cleanup = entry.get("cleanup")
    if not isinstance(cleanup, dict):
        cleanup = cleanup_result(str(entry.get("ended_at")))
    return {"instance_id": entry.get("instance_id"),
            "workspace_id": entry.get("workspace_id"),
            "state": entry.get("state"),
            "confirmed_on_disk": bool(entry.get("confirmed_on_disk")),
            "ended_at": entry.get("ended_at"),
            "cleanup": {k: cleanup.get(k) for k in (*ITEMS, "observed_at")}}


def registry_handlers(registry: Registry) -> dict[str, CommandHandler]:
    """``registry.list{limit}`` → ``{entries, more}``; ``registry.delete{instance_ids}``
    → ``{deleted}`` (docs/architecture.md)."""

    async def list_(args: dict[str, Any]) -> dict[str, Any]:
        parsed = parse_args(RegistryListArgs, args)
        entries, more = await trio.to_thread.run_sync(registry.entries, parsed.limit)
        return {"entries": entries, "more": more}

    async def delete(args: dict[str, Any]) -> dict[str, Any]:
        parsed = parse_args(RegistryDeleteArgs, args)
        deleted = await trio.to_thread.run_sync(registry.delete, parsed.instance_ids)
        return {"deleted": deleted}

    return {RegistryListArgs.KIND: list_, RegistryDeleteArgs.KIND: delete}


#: The Volume, writable-layer and Template preparation commands whose results go to
#: ``volume-commands.json``.
PREPARATION_KINDS = frozenset(cls.KIND for cls in (
    LayerDeleteArgs, VolumeCreateArgs, VolumeDeleteArgs, ObjectExpandArgs, ObjectCopyArgs,
    ObjectExportArgs, ObjectImportArgs))


def command_key(args: Mapping[str, Any]) -> str:
    """``<pool>/<object>`` of a preparation command's arguments."""
    pool = args.get("pool_id") or args.get("from_pool_id") or "-"
    obj = args.get("object_id") or args.get("volume_id") or args.get("ref") or "-"
    return f"{pool}/{obj}"


def recording(handlers: Mapping[str, CommandHandler], registry: Registry
              ) -> dict[str, CommandHandler]:
    """`handlers` with the result of every successful preparation command recorded in
    ``volume-commands.json`` (a failure to record is logged: the command did happen)."""

    def wrap(kind: str, handler: CommandHandler) -> CommandHandler:
        async def run(args: dict[str, Any]) -> dict[str, Any]:
            result = await handler(args)
            try:
                await trio.to_thread.run_sync(
                    lambda: registry.record_volume_command(kind, command_key(args), result))
            except (FailedPrecondition, OSError) as exc:
                log.warning("volume command not recorded", kind=kind, error=str(exc))
            return result
        return run

    return {kind: wrap(kind, h) if kind in PREPARATION_KINDS else h
            for kind, h in handlers.items()}


async def prune_loop(registry: Registry, interval: float = 3600.0) -> None:
    """``volume-commands.json`` entries are kept 24 h: pruned at start and hourly, besides
    on every write."""
    while True:
        try:
            await trio.to_thread.run_sync(registry.prune_volume_commands)
        except (FailedPrecondition, OSError) as exc:
            log.warning("volume command records not pruned", path=registry.dir, error=str(exc))
        await trio.sleep(interval)
