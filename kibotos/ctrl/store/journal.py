"""The command journal: a write with a command ID happens once.

A write carrying ``command_id`` stores its result in the same transaction that made the
change, so the two commit together or not at all.  Sending the ID again with the same
input (a digest over the operation, the path parameters and the body without
``command_id``) returns the stored result, also after ctrl restarted; the same ID with
other input is refused with ``already_exists`` naming the earlier operation.

Failures are stored too when they are a verdict on the request (`not_found`,
`failed_precondition`, `already_exists`), so a replay gets the same answer.  Failures a
retry may cure are not stored: ``aborted`` (a stale expected revision, which changes
nothing and stays stale), ``unavailable``, ``internal``.  Bad input never reaches the
journal: the request models refuse it first, and nothing is written.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any

from sqlalchemy import bindparam, insert, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from kibotos.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    Internal,
    KibotosError,
    NotFound,
    error_from_wire,
)
from kibotos.ctrl.store.db import Store
from kibotos.ctrl.store.models import Command
from kibotos.ctrl.wire.base import WriteRequest

STORED_ERRORS: tuple[type[KibotosError], ...] = (NotFound, FailedPrecondition, AlreadyExists)

Txn = Callable[[Session], dict[str, Any]]


def input_digest(operation: str, params: dict[str, Any], body: WriteRequest | None) -> str:
    """sha256 over a canonical JSON of what the write asked for.  Fields left out and
    fields sent as null are the same input."""
    payload = {
        "operation": operation,
        "params": params,
        "body": {} if body is None else body.model_dump(
            mode="json", exclude={"command_id"}, exclude_none=True),
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _lock_command_id(session: Session, command_id: str) -> None:
    """Serialise transactions that carry the same command ID.  ``FOR UPDATE`` cannot
    lock a row that does not exist yet, so on PostgreSQL two concurrent first attempts
    take a transaction-scoped advisory lock on the ID's hash: the second waits, then
    finds the first's entry and replays it.  SQLite has one writer at a time anyway."""
    if session.get_bind().dialect.name == "postgresql":
        key = int.from_bytes(hashlib.sha256(command_id.encode()).digest()[:8], "big",
                             signed=True)
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})


@dataclass(frozen=True)
class Outcome:
    result: dict[str, Any]
    #: True when the result came from the journal and nothing was done now; callers
    #: run after-commit effects (closing sessions, pushing ratios) only when False.
    replayed: bool


@dataclass(frozen=True)
class _Stored:
    operation: str
    digest: str
    status: str
    result: dict[str, Any] | None
    error: dict[str, Any] | None


def _stored(row: Command) -> _Stored:
    return _Stored(row.operation, row.input_digest, row.status, row.result, row.error)


#: The entry's columns as a plain row (Core, not an ORM object: every journaled write
#: reads it, usually to find nothing).  Built once.
_ENTRY = select(Command.operation, Command.input_digest, Command.status, Command.result,
                Command.error).where(Command.command_id == bindparam("command_id"))
_ENTRY_FOR_UPDATE = _ENTRY.with_for_update()


def _entry(session: Session, command_id: str, for_update: bool) -> _Stored | None:
    row = session.execute(_ENTRY_FOR_UPDATE if for_update else _ENTRY,
                          {"command_id": command_id}).first()
    return None if row is None else _Stored(row[0], row[1], row[2], row[3], row[4])


class Journal:
    def __init__(self, store: Store, now: Callable[[], datetime]) -> None:
        self.store = store
        self.now = now

    async def execute(self, *, operation: str, params: dict[str, Any],
                      body: WriteRequest | None, identity_id: str | None,
                      fn: Txn) -> Outcome:
        """Run `fn` in one transaction, journaled under the body's command ID if any."""
        command_id = body.command_id if body is not None else None
        if command_id is None:
            return Outcome(await self.store.write(fn), replayed=False)
        digest = input_digest(operation, params, body)
        for attempt in range(2):
            try:
                done = await self.store.write(
                    partial(self._run, command_id, operation, digest, identity_id, fn))
            except STORED_ERRORS as exc:
                stored = await self.store.write(
                    partial(self._record_failure, command_id, operation, digest,
                            identity_id, exc))
                if stored is None:
                    raise
                return self._replay(command_id, operation, digest, stored)
            except Internal as exc:
                # Two replicas raced to journal the same ID: the loser replays.
                if attempt == 0 and isinstance(exc.__cause__, IntegrityError):
                    continue
                raise
            if isinstance(done, _Stored):
                return self._replay(command_id, operation, digest, done)
            return Outcome(done, replayed=False)
        raise Internal(f"command {command_id}: could not journal the write")  # pragma: no cover

    async def lookup(self, *, operation: str, params: dict[str, Any],
                     body: WriteRequest | None) -> Outcome | None:
        """The stored outcome of the body's command ID, if it has one: for writes that
        must talk to a node *before* their transaction (a create is accepted by a node,
        then recorded), so a replay is answered without doing the work again.  Raises
        the stored refusal, or `AlreadyExists` for the same ID with other input."""
        command_id = body.command_id if body is not None else None
        if command_id is None:
            return None
        digest = input_digest(operation, params, body)
        stored = await self.store.run(partial(self._read, command_id))
        if stored is None:
            return None
        return self._replay(command_id, operation, digest, stored)

    async def refuse(self, *, operation: str, params: dict[str, Any],
                     body: WriteRequest | None, identity_id: str | None,
                     exc: KibotosError) -> None:
        """Journal a refusal reached outside `execute` (before the transaction) when it
        is a verdict, exactly as `execute` would, then raise it (or, if the ID was
        journaled meanwhile, raise or return per the stored entry)."""
        command_id = body.command_id if body is not None else None
        if command_id is None or not isinstance(exc, STORED_ERRORS):
            raise exc
        digest = input_digest(operation, params, body)
        stored = await self.store.write(partial(
            self._record_failure, command_id, operation, digest, identity_id, exc))
        if stored is None:
            raise exc
        self._replay(command_id, operation, digest, stored)
        raise exc

    @asynccontextmanager
    async def refusals(self, *, operation: str, params: dict[str, Any],
                       body: WriteRequest | None,
                       identity_id: str | None) -> AsyncIterator[None]:
        """The block of a write's checks before its transaction (where it goes, a node's
        facts, an artifact's manifest): a verdict raised in it (`STORED_ERRORS`) is
        journaled by `refuse`, as `execute` journals one, so a replay gets the same
        answer; anything else passes through unchanged."""
        try:
            yield
        except STORED_ERRORS as exc:
            await self.refuse(operation=operation, params=params, body=body,
                              identity_id=identity_id, exc=exc)
            raise  # pragma: no cover - refuse always raises

    @staticmethod
    def _read(command_id: str, session: Session) -> _Stored | None:
        return _entry(session, command_id, for_update=False)

    def _run(self, command_id: str, operation: str, digest: str, identity_id: str | None,
             fn: Txn, session: Session) -> dict[str, Any] | _Stored:
        _lock_command_id(session, command_id)
        stored = _entry(session, command_id, for_update=True)
        if stored is not None:
            return stored
        result = fn(session)
        # A plain INSERT: the entry is never changed in this transaction, so the ORM's
        # unit of work would only add its bookkeeping to every journaled write.
        session.execute(insert(Command), [{
            "command_id": command_id, "operation": operation, "input_digest": digest,
            "status": "succeeded", "result": result, "error": None,
            "identity_id": identity_id, "created_at": self.now()}])
        return result

    def _record_failure(self, command_id: str, operation: str, digest: str,
                        identity_id: str | None, exc: KibotosError,
                        session: Session) -> _Stored | None:
        """Store the verdict after `fn`'s transaction rolled back.  Returns the earlier
        entry if another request journaled this ID in between, else None."""
        _lock_command_id(session, command_id)
        row = session.get(Command, command_id, with_for_update=True)
        if row is not None:
            return _stored(row)
        session.add(Command(command_id=command_id, operation=operation, input_digest=digest,
                            status="failed", result=None, error=exc.to_wire()["error"],
                            identity_id=identity_id, created_at=self.now()))
        return None

    @staticmethod
    def _replay(command_id: str, operation: str, digest: str, stored: _Stored) -> Outcome:
        if stored.operation != operation or stored.digest != digest:
            raise AlreadyExists(
                f"command ID {command_id!r} was already used for {stored.operation} "
                "with other input: use a new command ID for a different request",
                details={"command_id": command_id, "operation": stored.operation},
            )
        if stored.status == "failed":
            raise error_from_wire({"error": stored.error})
        assert stored.result is not None
        return Outcome(stored.result, replayed=True)
