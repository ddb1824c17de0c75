"""Egresses and Resolvers in the store: create, update, delete, read, and who may have
an Egress's credentials (docs/network.md, "Egress" and "Resolver").

Both are named, revisioned records like Templates.  An Egress's every revision is an
`EgressRevision` row with its password sealed (`kibotos.ctrl.store.secret_box`, bound
to the name and revision), because a running Instance keeps the revision it was sent
until it is switched or restarted, and its node may fetch that revision's credentials
at any time meanwhile.  Revisions that are not current and that no live Instance
references are deleted whenever a newer one is made.  Nothing here returns a password
except `credentials`, which the API hands only to a node running an Instance that
references that revision (`node_may_fetch`).

Deleting an Egress or Resolver that a Workspace which is not DELETED names is refused
(``failed_precondition`` naming them), and so is deleting an Egress a Resolver goes
through.  Every function runs inside one store transaction.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from kibotos.core.errors import Aborted, AlreadyExists, FailedPrecondition, NotFound
from kibotos.ctrl.model import instances as inst_mod
from kibotos.ctrl.model import workspace_records as w
from kibotos.ctrl.model.nodes import record_event
from kibotos.ctrl.store.models import (
    Egress,
    EgressRevision,
    Instance,
    Node,
    Resolver,
    Workspace,
    existing,
)
from kibotos.ctrl.store.secret_box import SecretBox
from kibotos.ctrl.wire.base import as_utc, iso
from kibotos.ctrl.wire.network import EgressCreateIn, EgressUpdateIn, ResolverCreateIn

#: How many referencing Workspaces a refusal names.
NAMED = 5
_ENDED = (inst_mod.I_STOPPED, inst_mod.I_DESTROYED)


def _context(name: str, revision: int) -> str:
    """What a sealed password is bound to."""
    return f"egress {name} revision {revision}"


def egress_json(row: Egress) -> dict[str, Any]:
    return {"name": row.name, "address": row.address,
            "authenticated": row.username is not None, "username": row.username,
            "revision": row.revision, "created_at": iso(as_utc(row.created_at)),
            "updated_at": iso(as_utc(row.updated_at))}


def resolver_json(row: Resolver) -> dict[str, Any]:
    return {"name": row.name, "upstream": row.upstream, "via_egress": row.via_egress,
            "revision": row.revision, "created_at": iso(as_utc(row.created_at)),
            "updated_at": iso(as_utc(row.updated_at))}


def _check_version(kind: str, name: str, revision: int, expected: int | None) -> None:
    if expected is not None and expected != revision:
        raise Aborted(f"{kind} {name} is at revision {revision}, not {expected}; nothing "
                      "changed", details={"name": name, "revision": revision})


def get_egress(session: Session, name: str, *, for_update: bool = False) -> Egress:
    return existing(session, Egress, name, "egress", "name", for_update=for_update)


def get_resolver(session: Session, name: str, *, for_update: bool = False) -> Resolver:
    return existing(session, Resolver, name, "resolver", "name", for_update=for_update)


# ------------------------------------------------------------------------ Egress


def create_egress(session: Session, body: EgressCreateIn, box: SecretBox,
                  now: datetime) -> dict[str, Any]:
    if session.get(Egress, body.name, with_for_update=True) is not None:
        raise AlreadyExists(f"egress {body.name} already exists (update it with `kibo "
                            "egress update`)", details={"name": body.name})
    row = Egress(name=body.name, address=body.address, username=body.username, revision=1,
                 created_at=now, updated_at=now)
    session.add(row)
    password = body.password.get_secret_value() if body.password is not None else None
    _add_revision(session, row, password, box, now)
    record_event(session, now, f"egress/{body.name}", "egress.created",
                 {"revision": 1, "address": body.address,
                  "authenticated": body.username is not None})
    return egress_json(row)


def _add_revision(session: Session, row: Egress, password: str | None, box: SecretBox,
                  now: datetime) -> None:
    sealed = None if password is None else box.seal(password, _context(row.name, row.revision))
    session.add(EgressRevision(name=row.name, revision=row.revision, address=row.address,
                               username=row.username, password_sealed=sealed,
                               created_at=now))


def _current_password(session: Session, row: Egress, box: SecretBox) -> str | None:
    rev = session.get(EgressRevision, (row.name, row.revision))
    if rev is None or rev.password_sealed is None:
        return None
    return box.open(rev.password_sealed, _context(row.name, row.revision))


def update_egress(session: Session, name: str, body: EgressUpdateIn, box: SecretBox,
                  now: datetime) -> dict[str, Any]:
    """A new revision when something changes (credentials kept unless given or
    cleared); the same answer with ``unchanged`` when nothing does."""
    row = get_egress(session, name, for_update=True)
    _check_version("egress", name, row.revision, body.expected_version)
    old_password = password = _current_password(session, row, box)
    address, username = body.address or row.address, row.username
    if body.clear_credentials:
        username = password = None
    elif body.username is not None:
        assert body.password is not None
        username, password = body.username, body.password.get_secret_value()
    if (address, username, password) == (row.address, row.username, old_password):
        return {"egress": egress_json(row), "outcome": "unchanged"}
    row.address, row.username = address, username
    row.revision += 1
    row.updated_at = now
    _add_revision(session, row, password, box, now)
    session.flush()
    prune_revisions(session, name, row.revision)
    record_event(session, now, f"egress/{name}", "egress.updated",
                 {"revision": row.revision, "address": address,
                  "authenticated": username is not None})
    return {"egress": egress_json(row), "outcome": "updated"}


def referenced_revisions(session: Session, name: str) -> set[int]:
    """The revisions of Egress `name` that a live Instance was sent (its node may fetch
    their credentials)."""
    return {revision for _, revision in _live_references(session, name)}


def _live_references(session: Session, name: str,
                     node_id: str | None = None) -> Iterable[tuple[str, int]]:
    """(node, revision) of every Instance not ended that was sent Egress `name`.  Only
    Instances of Workspaces whose policy names it can have been (a switch records the
    Workspace's and the Instance's policy together), so the index narrows it down."""
    users = select(Workspace.workspace_id).where(Workspace.network_egress == name)
    query = select(Instance.node_id, Instance.network).where(
        Instance.workspace_id.in_(users), Instance.ended_at.is_(None),
        Instance.state.not_in(_ENDED), Instance.network.is_not(None))
    if node_id is not None:
        query = query.where(Instance.node_id == node_id)
    for node, network in session.execute(query):
        egress = network.get("egress") if isinstance(network, dict) else None
        if isinstance(egress, dict) and egress.get("name") == name \
                and isinstance(egress.get("revision"), int):
            yield str(node), int(egress["revision"])


def prune_revisions(session: Session, name: str, current: int) -> None:
    """Delete the revisions of `name` below `current` that no live Instance references:
    a secret is not kept longer than some node may need it."""
    keep = referenced_revisions(session, name) | {current}
    for rev in session.scalars(select(EgressRevision).where(EgressRevision.name == name)):
        if rev.revision not in keep:
            session.delete(rev)


def _workspaces_naming(session: Session, column: Any, name: str) -> list[str]:
    query = (select(Workspace.workspace_id)
             .where(column == name, Workspace.state != w.DELETED)
             .order_by(Workspace.workspace_id).limit(NAMED))
    return list(session.scalars(query))


def _refuse_if_used(kind: str, name: str, workspaces: list[str],
                    resolvers: list[str] | None = None) -> None:
    if workspaces:
        more = " and maybe others" if len(workspaces) >= NAMED else ""
        raise FailedPrecondition(
            f"{kind} {name} is used by Workspace {', '.join(workspaces)}{more}: delete "
            "those Workspaces or change their network policy first "
            "(`kibo workspace set-network`)",
            details={"name": name, "workspaces": workspaces})
    if resolvers:
        raise FailedPrecondition(
            f"{kind} {name} is used by Resolver {', '.join(resolvers)}: delete those "
            "first", details={"name": name, "resolvers": resolvers})


def delete_egress(session: Session, name: str, expected: int | None) -> dict[str, Any]:
    row = get_egress(session, name, for_update=True)
    _check_version("egress", name, row.revision, expected)
    resolvers = list(session.scalars(select(Resolver.name).where(Resolver.via_egress == name)
                                     .order_by(Resolver.name).limit(NAMED)))
    _refuse_if_used("egress", name, _workspaces_naming(session, Workspace.network_egress, name),
                    resolvers)
    out = egress_json(row)
    for rev in session.scalars(select(EgressRevision).where(EgressRevision.name == name)):
        session.delete(rev)
    session.delete(row)
    return out


def list_egresses(session: Session) -> dict[str, Any]:
    rows = session.scalars(select(Egress).order_by(Egress.name)).all()
    return {"egresses": [egress_json(r) for r in rows]}


def node_trusted(session: Session, node_id: str) -> bool:
    """A node that is isolated, retired or revoked is handed no secret, whatever its
    Instances were sent."""
    node = session.get(Node, node_id)
    return (node is not None and node.admission == "admitted"
            and node.isolated_incarnation is None and node.retired_at is None)


def node_may_fetch(session: Session, node_id: str, name: str, revision: int) -> bool:
    """Whether node `node_id` runs an Instance that was sent Egress `name` at
    `revision` (the only caller the credentials are handed to)."""
    return node_trusted(session, node_id) and any(
        rev == revision for _, rev in _live_references(session, name, node_id))


def credentials(session: Session, name: str, revision: int,
                box: SecretBox) -> dict[str, Any]:
    rev = session.get(EgressRevision, (name, revision))
    if rev is None:
        raise NotFound(f"egress {name} has no revision {revision}",
                       details={"name": name, "revision": revision})
    password = None if rev.password_sealed is None else box.open(
        rev.password_sealed, _context(name, revision))
    return {"name": name, "revision": revision, "address": rev.address,
            "username": rev.username, "password": password}


# ------------------------------------------------------------------------ Resolver


def create_resolver(session: Session, body: ResolverCreateIn,
                    now: datetime) -> dict[str, Any]:
    if session.get(Resolver, body.name, with_for_update=True) is not None:
        raise AlreadyExists(f"resolver {body.name} already exists",
                            details={"name": body.name})
    if body.via_egress is not None:
        get_egress(session, body.via_egress, for_update=True)
    row = Resolver(name=body.name, upstream=body.upstream, via_egress=body.via_egress,
                   revision=1, created_at=now, updated_at=now)
    session.add(row)
    record_event(session, now, f"resolver/{body.name}", "resolver.created",
                 {"upstream": body.upstream, "via_egress": body.via_egress})
    return resolver_json(row)


def delete_resolver(session: Session, name: str, expected: int | None) -> dict[str, Any]:
    row = get_resolver(session, name, for_update=True)
    _check_version("resolver", name, row.revision, expected)
    _refuse_if_used("resolver", name,
                    _workspaces_naming(session, Workspace.network_resolver, name))
    out = resolver_json(row)
    session.delete(row)
    return out


def list_resolvers(session: Session) -> dict[str, Any]:
    rows = session.scalars(select(Resolver).order_by(Resolver.name)).all()
    return {"resolvers": [resolver_json(r) for r in rows]}
