"""Who is calling: bearer credentials ``<identity_id>:<secret>`` checked against the store.

The store keeps sha256(secret); the check hashes what the caller sent and compares in
constant time.  Verified identities are cached briefly so a busy CLI or a thousand
node sessions do not cost one query each; a revoke drops the entry at once (in this
process), and the short lifetime bounds how long another replica may still trust it.
Operator endpoints refuse node identities, and the reverse.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from sqlalchemy.orm import Session

from kibotos.core.errors import PermissionDenied, Unauthenticated
from kibotos.ctrl.model.enrollment import IDENTITY_PREFIX, hash_secret, secret_matches
from kibotos.ctrl.store.db import Store
from kibotos.ctrl.store.models import Identity


@dataclass(frozen=True)
class Caller:
    identity_id: str
    kind: str  # "node" | "operator"
    node_id: str | None
    name: str | None
    revoked: bool


def parse_authorization(header: str | None) -> tuple[str, str]:
    if not header:
        raise Unauthenticated(
            "missing credential: send 'Authorization: Bearer <identity_id>:<secret>'")
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        raise Unauthenticated("unsupported authorization scheme: expected Bearer")
    identity_id, sep, secret = value.strip().partition(":")
    if not sep or not identity_id.startswith(IDENTITY_PREFIX + "-") or not secret:
        raise Unauthenticated("malformed credential: expected <identity_id>:<secret>")
    return identity_id, secret


@dataclass
class _Entry:
    secret_hash: str
    caller: Caller
    at: float


class Authenticator:
    def __init__(self, store: Store, *, ttl: float = 10.0, max_entries: int = 4096) -> None:
        self.store = store
        self.ttl = ttl
        self.max_entries = max_entries
        self._cache: OrderedDict[str, _Entry] = OrderedDict()

    async def verify(self, header: str | None) -> Caller:
        """The caller named by an Authorization header, revoked or not.  An unknown
        identity and a wrong secret get the same answer."""
        identity_id, secret = parse_authorization(header)
        entry = self._cache.get(identity_id)
        if entry is not None and time.monotonic() - entry.at < self.ttl:
            if not secret_matches(secret, entry.secret_hash):
                raise Unauthenticated("unknown identity or wrong secret")
            self._cache.move_to_end(identity_id)
            return entry.caller

        def load(session: Session) -> tuple[str, Caller] | None:
            row = session.get(Identity, identity_id)
            if row is None:
                return None
            return row.secret_hash, Caller(row.identity_id, row.kind, row.node_id, row.name,
                                           row.revoked_at is not None)

        found = await self.store.run(load)
        if found is None or not secret_matches(secret, found[0]):
            # Hash anyway so a missing identity costs what a wrong secret does.
            hash_secret(secret)
            raise Unauthenticated("unknown identity or wrong secret")
        secret_hash, caller = found
        if not caller.revoked:
            self._cache[identity_id] = _Entry(secret_hash, caller, time.monotonic())
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return caller

    async def identity(self, header: str | None) -> Caller:
        caller = await self.verify(header)
        if caller.revoked:
            raise Unauthenticated(f"identity {caller.identity_id} has been revoked")
        return caller

    async def operator(self, header: str | None) -> Caller:
        return await self._of_kind(header, "operator")

    async def node(self, header: str | None) -> Caller:
        return await self._of_kind(header, "node")

    async def _of_kind(self, header: str | None, kind: str) -> Caller:
        """A live identity of `kind`; the other kind is `permission_denied`."""
        caller = await self.identity(header)
        if caller.kind != kind:
            article = "an" if caller.kind == "operator" else "a"
            raise PermissionDenied(
                f"identity {caller.identity_id} is {article} {caller.kind} identity: "
                f"this endpoint is for {kind}s")
        return caller

    def forget(self, identity_ids: list[str]) -> None:
        """Drop cached identities (called right after a revoke commits)."""
        for identity_id in identity_ids:
            self._cache.pop(identity_id, None)
