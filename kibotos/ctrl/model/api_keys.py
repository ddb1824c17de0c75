"""API keys in the store: create (the key shown once), list, revoke, verify.

A key is ``kak-<id>.<secret>``, the shape of an enrollment grant's token, and like it
only sha256(secret) is stored.  Verification is what a gateway asks for every call of
its own callers: an unknown key, a wrong secret and a revoked key all get the same
`Unauthenticated` (a caller learns nothing about which keys exist), and a missing key
costs the hash a wrong one does.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from kibotos.core import ids
from kibotos.core.errors import FailedPrecondition, NotFound, Unauthenticated
from kibotos.ctrl.model.enrollment import hash_secret, new_secret, secret_matches
from kibotos.ctrl.store.models import ApiKey
from kibotos.ctrl.wire.base import iso

KEY_PREFIX = "kak"


def key_json(key: ApiKey) -> dict[str, Any]:
    return {"key_id": key.key_id, "name": key.name, "team": key.team,
            "state": "revoked" if key.revoked_at is not None else "active",
            "created_at": iso(key.created_at), "created_by": key.created_by,
            "revoked_at": iso(key.revoked_at)}


def create(session: Session, *, name: str, team: str, created_by: str | None,
           now: datetime) -> tuple[dict[str, Any], str]:
    """A new key: its record and, apart, the whole key (never stored)."""
    secret = new_secret()
    key = ApiKey(key_id=ids.new_id(KEY_PREFIX), name=name, team=team,
                 secret_hash=hash_secret(secret), created_at=now, created_by=created_by)
    session.add(key)
    return key_json(key), f"{key.key_id}.{secret}"


def reissue(session: Session, key_id: str) -> str:
    """A fresh secret for a key whose create is replayed: the key was shown once, so a
    replay can only show a new one (the old one stops working).  A revoked key stays
    revoked."""
    key = session.get(ApiKey, key_id, with_for_update=True)
    if key is None or key.revoked_at is not None:
        raise FailedPrecondition(f"API key {key_id} is revoked: it cannot be shown again",
                                 details={"key_id": key_id})
    secret = new_secret()
    key.secret_hash = hash_secret(secret)
    return f"{key.key_id}.{secret}"


def list_all(session: Session) -> dict[str, Any]:
    rows = session.scalars(select(ApiKey).order_by(ApiKey.key_id))
    return {"api_keys": [key_json(k) for k in rows]}


def revoke(session: Session, key_id: str, now: datetime) -> dict[str, Any]:
    """Revoke a key (revoking a revoked key changes nothing and is no error)."""
    ids.check_object_id(key_id, "API key ID")
    key = session.get(ApiKey, key_id, with_for_update=True)
    if key is None:
        raise NotFound(f"no API key {key_id}", details={"key_id": key_id})
    if key.revoked_at is None:
        key.revoked_at = now
    return key_json(key)


def verify(session: Session, token: str) -> dict[str, Any]:
    """Whose key `token` is: ``{key_id, name, team}``; `Unauthenticated` otherwise."""
    key_id, sep, secret = token.strip().partition(".")
    key = None
    if sep and secret and key_id.startswith(KEY_PREFIX + "-") and len(key_id) <= 40:
        key = session.get(ApiKey, key_id)
    if key is None or not secret_matches(secret, key.secret_hash) or key.revoked_at:
        if key is None:
            hash_secret(secret)
        raise Unauthenticated("invalid API key (unknown, revoked or wrong)")
    return {"key_id": key.key_id, "name": key.name, "team": key.team}
