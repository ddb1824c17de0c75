"""HTTP API of the artifact store and of Templates (docs/templates.md).

Artifacts: ``PUT /v1/artifacts/sha256/{hex}`` (operator or node: a node uploads the
Transfer archives it exports; the body is the blob, checked against the digest in the
path, so no caller can store anything under a name it does not hash to),
``GET``/``HEAD`` (operator or node; streamed from the file, byte ranges allowed).  An
upload is idempotent by nature, so it does not go through the command journal.

Templates: ``PUT /v1/templates/{name}`` points a name at three blobs that must already
be in the store (image, kernel, initramfs); ``GET`` lists or reads them; ``DELETE``
removes the name while no Workspace uses it.  Writes are journaled.  Whether the blobs
exist is checked before the journal, so "upload first" is never stored as a verdict a
retry would replay.  Deleting a Template leaves its blobs: another Template may share
them, and they are immutable, so keeping them is always safe.
"""

from __future__ import annotations

from datetime import datetime
from functools import partial
from typing import Any

import trio
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.requests import Request

from kibotos.core import ids
from kibotos.core.errors import Aborted, FailedPrecondition, NotFound
from kibotos.ctrl.api.auth import Caller
from kibotos.ctrl.api.routing import OCTET_STREAM, Api, Route, declares, read_body
from kibotos.ctrl.store.artifacts import ArtifactStore, BlobResponse
from kibotos.ctrl.store.models import Template, Workspace, existing
from kibotos.ctrl.wire.base import (
    ArtifactOut,
    TemplateListOut,
    TemplateOut,
    TemplatePutIn,
    TemplatePutOut,
    VersionedWrite,
    as_utc,
    iso,
)

#: ext4's superblock magic sits at byte 1080 of the image (0xEF53, little-endian).
EXT4_MAGIC = (1080, b"\x53\xef")
ELF_MAGIC = (0, b"\x7fELF")


def template_json(row: Template) -> dict[str, Any]:
    return {
        "name": row.name,
        "image": {"digest": row.image_digest, "size": row.image_size},
        "kernel_digest": row.kernel_digest,
        "initramfs_digest": row.initramfs_digest,
        "source": row.source,
        "created_at": iso(as_utc(row.created_at)),
        "updated_at": iso(as_utc(row.updated_at)),
        "revision": row.revision,
    }


def _path_name(request: Request) -> str:
    return ids.check_template_name(request.path_params["name"])


def _path_digest(request: Request) -> str:
    return ids.check_sha256_hex(request.path_params["hex"])


def check_blobs(store: ArtifactStore, body: TemplatePutIn) -> int:
    """Every blob is in the store and looks like what it is named as; returns the image
    size.  A kernel that is not an ELF file or an image that is not ext4 is almost
    always two digests given in the wrong order, caught here rather than at boot."""
    missing = [d for d in (body.image_digest, body.kernel_digest, body.initramfs_digest)
               if store.size(d) is None]
    if missing:
        raise FailedPrecondition(
            f"upload the blobs first: the artifact store has no {', '.join(missing)} "
            "(PUT /v1/artifacts/sha256/<hex>)", details={"missing": missing})
    for what, digest, (offset, magic), kind in (
            ("image", body.image_digest, EXT4_MAGIC, "an ext4 file system"),
            ("kernel", body.kernel_digest, ELF_MAGIC, "an ELF vmlinux")):
        if store.read_head(digest, offset, len(magic)) != magic:
            raise FailedPrecondition(f"the {what} {digest} is not {kind}",
                                     details={"field": f"{what}_digest", "digest": digest})
    size = store.size(body.image_digest)
    assert size is not None
    return size


def put_template(session: Session, name: str, body: TemplatePutIn, image_size: int,
                 now: datetime) -> dict[str, Any]:
    row = session.get(Template, name, with_for_update=True)
    current = 0 if row is None else row.revision
    if body.expected_version is not None and body.expected_version != current:
        raise Aborted(
            f"template {name} is at revision {current}, not {body.expected_version}"
            + (" (0: it does not exist)" if current == 0 else "") + "; nothing changed",
            details={"name": name, "revision": current})
    fields = {"image_digest": body.image_digest, "image_size": image_size,
              "kernel_digest": body.kernel_digest,
              "initramfs_digest": body.initramfs_digest, "source": body.source}
    if row is None:
        row = Template(name=name, created_at=now, updated_at=now, revision=1, **fields)
        session.add(row)
        outcome = "created"
    elif all(getattr(row, k) == v for k, v in fields.items()):
        outcome = "unchanged"
    else:
        for key, value in fields.items():
            setattr(row, key, value)
        row.revision += 1
        row.updated_at = now
        outcome = "updated"
    session.flush()
    return {"template": template_json(row), "outcome": outcome}


def workspaces_using(session: Session, name: str, limit: int = 5) -> list[str]:
    """IDs of Workspaces that use Template `name` and are not DELETED (a Workspace
    copies the digests at create, but its name still ties it to the Template)."""
    query = (select(Workspace.workspace_id)
             .where(Workspace.template_name == name, Workspace.state != "DELETED")
             .order_by(Workspace.workspace_id).limit(limit))
    return list(session.scalars(query))


def delete_template(session: Session, name: str, expected_version: int | None
                    ) -> dict[str, Any]:
    row = session.get(Template, name, with_for_update=True)
    if row is None:
        raise NotFound(f"template {name} does not exist", details={"name": name})
    if expected_version is not None and expected_version != row.revision:
        raise Aborted(f"template {name} is at revision {row.revision}, not "
                      f"{expected_version}; nothing changed",
                      details={"name": name, "revision": row.revision})
    users = workspaces_using(session, name)
    if users:
        raise FailedPrecondition(
            f"template {name} is used by Workspace {', '.join(users)}"
            + (" and maybe others" if len(users) >= 5 else "")
            + ": delete those Workspaces first", details={"name": name, "workspaces": users})
    out = template_json(row)
    session.delete(row)
    return out


def _get(name: str, session: Session) -> dict[str, Any]:
    return template_json(existing(session, Template, name, "template", "name"))


def _list(session: Session) -> dict[str, Any]:
    rows = session.scalars(select(Template).order_by(Template.name)).all()
    return {"templates": [template_json(r) for r in rows]}


def routes(api: Api, artifacts: ArtifactStore) -> list[Route]:
    ctx = api.ctx

    async def put_artifact(request: Request, caller: Caller | None) -> dict[str, Any]:
        digest = _path_digest(request)
        declares(request, OCTET_STREAM)
        done = await artifacts.put(digest, request.stream())
        return {"digest": done.digest, "size": done.size, "created": done.created}

    async def get_artifact(request: Request, caller: Caller | None) -> BlobResponse:
        return artifacts.response(_path_digest(request))

    async def put_template_route(request: Request, caller: Caller | None) -> dict[str, Any]:
        assert caller is not None
        name = _path_name(request)
        body = await read_body(request, TemplatePutIn)
        image_size = await trio.to_thread.run_sync(check_blobs, artifacts, body)
        return await api.journaled("template.put", {"name": name}, body, caller,
                                   lambda s: put_template(s, name, body, image_size, ctx.now()))

    async def list_templates(request: Request, caller: Caller | None) -> dict[str, Any]:
        return await ctx.store.run(_list)

    async def get_template(request: Request, caller: Caller | None) -> dict[str, Any]:
        return await ctx.store.run(partial(_get, _path_name(request)))

    async def delete_template_route(request: Request, caller: Caller | None
                                    ) -> dict[str, Any]:
        assert caller is not None
        name = _path_name(request)
        body = await read_body(request, VersionedWrite)
        return await api.journaled("template.delete", {"name": name}, body, caller,
                                   lambda s: delete_template(s, name, body.expected_version))

    return [
        Route("PUT", "/v1/artifacts/sha256/{hex}", put_artifact,
              "Upload a blob (the request body, application/octet-stream); stored only "
              "if its sha256 is the one in the path (nodes upload Transfer archives)",
              result=ArtifactOut, who="identity", bytes_body=True),
        Route("GET", "/v1/artifacts/sha256/{hex}", get_artifact,
              "Download a blob (also HEAD; byte ranges allowed)", who="identity",
              bytes_result=True),
        Route("PUT", "/v1/templates/{name}", put_template_route,
              "Create a Template or point it at other blobs (uploaded first)", body=TemplatePutIn,
              result=TemplatePutOut),
        Route("GET", "/v1/templates", list_templates, "List Templates by name",
              result=TemplateListOut),
        Route("GET", "/v1/templates/{name}", get_template, "One Template", result=TemplateOut,
              who="identity"),
        Route("DELETE", "/v1/templates/{name}", delete_template_route,
              "Delete a Template no Workspace uses (its blobs stay)", body=VersionedWrite,
              result=TemplateOut),
    ]
