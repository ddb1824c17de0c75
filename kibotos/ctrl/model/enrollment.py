"""Enrollment rules in the store: issuing grants, exchanging them once, revoking.

These functions run inside one store transaction (`Store.write`) and are shared by the
HTTP API (`api_enrollment.py`) and by ``kibotos ctrl grant``, which writes the store
directly on the ctrl host: that is how the first operator gets in.  Secrets are never
stored: only their sha256.  See docs/enrollment.md for the operator's view.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    PublicFormat,
    load_pem_public_key,
)
from sqlalchemy import select
from sqlalchemy.orm import Session

from kibotos.core import ids
from kibotos.core.errors import FailedPrecondition, InvalidArgument, NotFound, Unauthenticated
from kibotos.ctrl.model import nodes
from kibotos.ctrl.store.models import EnrollmentGrant, Identity, Node
from kibotos.ctrl.wire.base import as_utc, iso

GRANT_PREFIX = "kgr"
IDENTITY_PREFIX = "kid"
DEFAULT_GRANT_TTL_S = 24 * 3600.0


def new_secret() -> str:
    """32 random bytes, urlsafe base64 without padding (43 characters)."""
    return base64.urlsafe_b64encode(os.urandom(32)).rstrip(b"=").decode()


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def secret_matches(secret: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_secret(secret), stored_hash)


def parse_grant_token(token: str) -> tuple[str, str]:
    """Split ``kgr-<id>.<secret>``; a token of another shape is refused as unauthenticated
    (it cannot name a grant), with a message saying what shape was expected."""
    grant_id, sep, secret = token.strip().partition(".")
    if not sep or not grant_id.startswith(GRANT_PREFIX + "-") or not secret:
        raise Unauthenticated("malformed enrollment grant: expected kgr-<id>.<secret>")
    return grant_id, secret


def normalize_public_key(value: str) -> str:
    """Accept an Ed25519 public key as base64 of its 32 raw bytes (standard or urlsafe
    alphabet, padding optional) or as PEM; store it as standard base64 of the raw key."""
    text = value.strip()
    raw: bytes
    try:
        if text.startswith("-----BEGIN"):
            key = load_pem_public_key(text.encode())
            if not isinstance(key, Ed25519PublicKey):
                raise InvalidArgument("public_key: not an Ed25519 public key")
            raw = key.public_bytes(Encoding.Raw, PublicFormat.Raw)
        else:
            padded = text.replace("-", "+").replace("_", "/") + "=" * (-len(text) % 4)
            raw = base64.b64decode(padded, validate=True)
            Ed25519PublicKey.from_public_bytes(raw)
    except (ValueError, binascii.Error) as exc:
        raise InvalidArgument(
            f"public_key: not an Ed25519 public key (base64 of 32 raw bytes, or PEM): {exc}"
        ) from None
    return base64.b64encode(raw).decode()


def grant_state(grant: EnrollmentGrant, now: datetime) -> str:
    if grant.revoked_at is not None:
        return "revoked"
    if grant.used_at is not None:
        return "used"
    if grant.expires_at is not None and as_utc(grant.expires_at) <= now:
        return "expired"
    return "pending"


def grant_json(grant: EnrollmentGrant, now: datetime) -> dict[str, Any]:
    return {
        "grant_id": grant.grant_id,
        "kind": grant.kind,
        "node_id": grant.node_id,
        "name": grant.name,
        "state": grant_state(grant, now),
        "created_at": iso(grant.created_at),
        "created_by": grant.created_by,
        "expires_at": iso(grant.expires_at),
        "used_at": iso(grant.used_at),
        "identity_id": grant.identity_id,
        "revoked_at": iso(grant.revoked_at),
    }


def identity_json(identity: Identity) -> dict[str, Any]:
    return {
        "identity_id": identity.identity_id,
        "kind": identity.kind,
        "node_id": identity.node_id,
        "name": identity.name,
        "grant_id": identity.grant_id,
        "state": "revoked" if identity.revoked_at is not None else "active",
        "created_at": iso(identity.created_at),
        "revoked_at": iso(identity.revoked_at),
    }


def create_grant(
    session: Session,
    *,
    kind: str,
    node_id: str | None,
    name: str | None,
    expires_in_s: float | None,
    created_by: str | None,
    now: datetime,
) -> dict[str, Any]:
    """Issue a one-time grant and return its token (shown once, never stored)."""
    if kind not in ("node", "operator"):
        raise InvalidArgument(f"kind must be node or operator, got {kind!r}")
    if kind == "node":
        if node_id is None:
            raise InvalidArgument("node_id is required for a node grant")
        ids.check_node_id(node_id)
        node = session.get(Node, node_id)
        if node is not None and node.retired_at is not None:
            raise FailedPrecondition(
                f"node {node_id} is retired: a new host needs a new node ID",
                details={"node_id": node_id},
            )
    elif node_id is not None:
        raise InvalidArgument("node_id must not be given for an operator grant")
    ttl = DEFAULT_GRANT_TTL_S if expires_in_s is None else expires_in_s
    if ttl <= 0:
        raise InvalidArgument(f"expiry must be positive, got {ttl} s")
    secret = new_secret()
    grant = EnrollmentGrant(
        grant_id=ids.new_id(GRANT_PREFIX),
        kind=kind,
        node_id=node_id,
        name=name,
        secret_hash=hash_secret(secret),
        created_at=now,
        created_by=created_by,
        expires_at=now + timedelta(seconds=ttl),
    )
    session.add(grant)
    nodes.record_event(session, now, grant.grant_id, "grant.created",
                       {"kind": kind, "node_id": node_id, "created_by": created_by})
    return {
        "grant_id": grant.grant_id,
        "token": f"{grant.grant_id}.{secret}",
        "kind": kind,
        "node_id": node_id,
        "name": name,
        "expires_at": iso(grant.expires_at),
    }


def exchange(session: Session, *, token: str, public_key: str, now: datetime) -> dict[str, Any]:
    """Turn a grant into an identity, once.  A node grant also creates (or re-admits)
    the Node record; a retired node ID is refused."""
    grant_id, secret = parse_grant_token(token)
    grant = session.get(EnrollmentGrant, grant_id, with_for_update=True)
    if grant is None or not secret_matches(secret, grant.secret_hash):
        raise Unauthenticated("unknown enrollment grant or wrong secret")
    state = grant_state(grant, now)
    if state != "pending":
        why = {"used": "has already been exchanged", "expired": "has expired",
               "revoked": "has been revoked"}[state]
        raise FailedPrecondition(f"enrollment grant {grant_id} {why}",
                                 details={"grant_id": grant_id, "state": state})
    key = normalize_public_key(public_key)
    if grant.kind == "node":
        assert grant.node_id is not None
        node = session.get(Node, grant.node_id, with_for_update=True)
        if node is None:
            session.add(nodes.new_node(grant.node_id, now))
        elif node.retired_at is not None:
            raise FailedPrecondition(f"node {grant.node_id} is retired and cannot enroll again",
                                     details={"node_id": grant.node_id})
        elif node.admission != "admitted":
            node.admission = "admitted"
            nodes.bump(node)
    identity_secret = new_secret()
    identity = Identity(
        identity_id=ids.new_id(IDENTITY_PREFIX),
        kind=grant.kind,
        node_id=grant.node_id,
        name=grant.name,
        grant_id=grant.grant_id,
        public_key=key,
        secret_hash=hash_secret(identity_secret),
        created_at=now,
    )
    session.add(identity)
    grant.used_at = now
    grant.identity_id = identity.identity_id
    nodes.record_event(session, now, identity.identity_id, "identity.created",
                       {"grant_id": grant_id, "kind": grant.kind, "node_id": grant.node_id})
    return {
        "identity_id": identity.identity_id,
        "credential": f"{identity.identity_id}:{identity_secret}",
        "kind": grant.kind,
        "node_id": grant.node_id,
    }


def list_all(session: Session, now: datetime) -> dict[str, Any]:
    grants = session.scalars(select(EnrollmentGrant).order_by(EnrollmentGrant.grant_id))
    identities = session.scalars(select(Identity).order_by(Identity.identity_id))
    return {
        "grants": [grant_json(g, now) for g in grants],
        "identities": [identity_json(i) for i in identities],
    }


@dataclass
class Revocation:
    """What a revoke changed, so the caller can drop caches and close sessions."""

    revoked: list[str] = field(default_factory=list)
    identity_ids: list[str] = field(default_factory=list)
    node_ids: list[str] = field(default_factory=list)


def _revoke_identity(session: Session, identity: Identity, now: datetime,
                     out: Revocation) -> None:
    if identity.revoked_at is not None:
        return
    identity.revoked_at = now
    out.revoked.append(identity.identity_id)
    out.identity_ids.append(identity.identity_id)
    if identity.kind == "node" and identity.node_id is not None:
        node = session.get(Node, identity.node_id, with_for_update=True)
        if node is not None and node.admission != "revoked":
            node.admission = "revoked"
            nodes.bump(node)
        out.node_ids.append(identity.node_id)
    nodes.record_event(session, now, identity.identity_id, "identity.revoked",
                       {"node_id": identity.node_id})


def revoke(session: Session, target: str, now: datetime) -> Revocation:
    """Revoke a grant or an identity.  Revoking a grant that was already exchanged also
    revokes the identity it produced.  Already revoked objects are left as they are."""
    out = Revocation()
    if target.startswith(GRANT_PREFIX + "-"):
        grant = session.get(EnrollmentGrant, target, with_for_update=True)
        if grant is None:
            raise NotFound(f"no enrollment grant {target}", details={"id": target})
        if grant.revoked_at is None:
            grant.revoked_at = now
            out.revoked.append(grant.grant_id)
            nodes.record_event(session, now, grant.grant_id, "grant.revoked", None)
        if grant.identity_id is not None:
            identity = session.get(Identity, grant.identity_id, with_for_update=True)
            if identity is not None:
                _revoke_identity(session, identity, now, out)
        return out
    if target.startswith(IDENTITY_PREFIX + "-"):
        identity = session.get(Identity, target, with_for_update=True)
        if identity is None:
            raise NotFound(f"no identity {target}", details={"id": target})
        _revoke_identity(session, identity, now, out)
        return out
    raise InvalidArgument(f"id must be a grant (kgr-…) or an identity (kid-…), got {target!r}")

