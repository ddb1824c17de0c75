"""The artifact store and Templates through the HTTP API (SQLite and PostgreSQL): upload
and download, digest checks that write nothing, who may call what, and the Template
rules (blobs first, revisions, expected versions, names, journal, delete)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest
from ctrl_helpers import bearer, enroll_node, error, result
from sqlalchemy.orm import Session
from templates_helpers import (
    blob_path,
    digest,
    image_blob,
    initramfs_blob,
    kernel_blob,
    upload,
    upload_set,
)

from kibotos.ctrl.live.context import CtrlContext, utcnow
from kibotos.ctrl.store.artifacts import artifact_root
from kibotos.ctrl.store.models import Workspace
from kibotos.ctrl.wire.base import ArtifactOut, TemplateListOut, TemplateOut, TemplatePutOut


def blob_dir(ctx: CtrlContext) -> Path:
    return artifact_root(ctx.config) / "sha256"


def stored_files(ctx: CtrlContext) -> list[str]:
    """Every file in the blob directory, temporaries included."""
    return sorted(p.name for p in blob_dir(ctx).iterdir())


# --------------------------------------------------------------------------- artifacts


async def test_upload_download_round_trip(client: httpx.AsyncClient, ctx: CtrlContext,
                                          operator: dict[str, str]) -> None:
    data = kernel_blob(b"round trip")
    resp = await client.put(blob_path(data), content=data, headers=operator)
    out = result(resp, ArtifactOut)
    assert out == {"digest": digest(data), "size": len(data), "created": True}
    assert stored_files(ctx) == [hashlib.sha256(data).hexdigest()]

    # Idempotent: the same upload again stores nothing new.
    again = result(await client.put(blob_path(data), content=data, headers=operator))
    assert again == {**out, "created": False}

    got = await client.get(blob_path(data), headers=operator)
    assert got.status_code == 200
    assert got.content == data
    assert got.headers["x-kibotos-digest"] == digest(data)
    head = await client.head(blob_path(data), headers=operator)
    assert head.status_code == 200
    assert int(head.headers["content-length"]) == len(data)
    assert head.content == b""
    part = await client.get(blob_path(data), headers={**operator, "Range": "bytes=4-9"})
    assert part.status_code == 206
    assert part.content == data[4:10]


async def test_a_digest_mismatch_writes_nothing(client: httpx.AsyncClient, ctx: CtrlContext,
                                                operator: dict[str, str]) -> None:
    data = image_blob()
    wrong = hashlib.sha256(b"something else").hexdigest()
    resp = await client.put(f"/v1/artifacts/sha256/{wrong}", content=data, headers=operator)
    err = error(resp, "invalid_argument")
    assert err["details"]["actual"] == digest(data)
    assert "nothing was stored" in err["message"]
    assert stored_files(ctx) == []  # not the blob, not a temporary file
    error(await client.get(f"/v1/artifacts/sha256/{wrong}", headers=operator), "not_found")

    # A wrong body for a blob that exists is refused too, and the blob is untouched.
    await upload(client, operator, data)
    resp = await client.put(blob_path(data), content=data + b"x", headers=operator)
    error(resp, "invalid_argument")
    assert (blob_dir(ctx) / hashlib.sha256(data).hexdigest()).read_bytes() == data
    assert len(stored_files(ctx)) == 1


@pytest.mark.parametrize("bad", ["ABC", "a" * 63, "A" * 64, "g" * 64, "a" * 65])
async def test_malformed_digests_are_refused(client: httpx.AsyncClient, ctx: CtrlContext,
                                             operator: dict[str, str], bad: str) -> None:
    resp = await client.put(f"/v1/artifacts/sha256/{bad}", content=b"x", headers=operator)
    assert "invalid digest" in error(resp, "invalid_argument")["message"]
    error(await client.get(f"/v1/artifacts/sha256/{bad}", headers=operator),
          "invalid_argument")
    assert stored_files(ctx) == []


async def test_who_may_upload_and_download(client: httpx.AsyncClient, ctx: CtrlContext,
                                           operator: dict[str, str]) -> None:
    data = initramfs_blob()
    node = bearer(await enroll_node(client, operator, "node-a"))
    error(await client.put(blob_path(data), content=data), "unauthenticated")
    assert stored_files(ctx) == []
    await upload(client, operator, data)
    assert (await client.get(blob_path(data), headers=node)).content == data
    error(await client.get(blob_path(data)), "unauthenticated")
    # a node uploads the Transfer archives it exports; the digest is checked as for all
    other = initramfs_blob() + b"node"
    error(await client.put(blob_path(other), content=other + b"x", headers=node),
          "invalid_argument")
    resp = await client.put(blob_path(other), content=other, headers=node)
    assert resp.status_code == 200, resp.text
    assert (await client.get(blob_path(other), headers=operator)).content == other


# --------------------------------------------------------------------------- templates


async def test_template_needs_its_blobs_first(client: httpx.AsyncClient,
                                             operator: dict[str, str]) -> None:
    body = {"image_digest": digest(image_blob()), "kernel_digest": digest(kernel_blob()),
            "initramfs_digest": digest(initramfs_blob())}
    err = error(await client.put("/v1/templates/base", json=body, headers=operator),
                "failed_precondition")
    assert sorted(err["details"]["missing"]) == sorted(body.values())
    error(await client.get("/v1/templates/base", headers=operator), "not_found")
    assert result(await client.get("/v1/templates", headers=operator)) == {"templates": []}


async def test_template_create_update_unchanged(client: httpx.AsyncClient,
                                               operator: dict[str, str]) -> None:
    body = await upload_set(client, operator)
    created = result(await client.put("/v1/templates/kibotos-base", headers=operator,
                                      json={**body, "source": {"kind": "test"}}),
                     TemplatePutOut)
    assert created["outcome"] == "created"
    tpl = created["template"]
    assert tpl["name"] == "kibotos-base"
    assert tpl["revision"] == 1
    assert tpl["image"] == {"digest": body["image_digest"], "size": 4096}
    assert tpl["kernel_digest"] == body["kernel_digest"]
    assert tpl["source"] == {"kind": "test"}

    same = result(await client.put("/v1/templates/kibotos-base", headers=operator,
                                   json={**body, "source": {"kind": "test"}}))
    assert same["outcome"] == "unchanged"
    assert same["template"] == tpl

    new_image = image_blob(b"v2")
    await upload(client, operator, new_image)
    body2 = {**body, "image_digest": digest(new_image)}
    stale = await client.put("/v1/templates/kibotos-base", headers=operator,
                             json={**body2, "expected_version": 7})
    assert error(stale, "aborted")["details"]["revision"] == 1
    updated = result(await client.put("/v1/templates/kibotos-base", headers=operator,
                                      json={**body2, "expected_version": 1}))
    assert updated["outcome"] == "updated"
    assert updated["template"]["revision"] == 2
    assert updated["template"]["image"]["size"] == 4098
    assert updated["template"]["created_at"] == tpl["created_at"]

    # expected_version 0: create only.
    error(await client.put("/v1/templates/kibotos-base", headers=operator,
                           json={**body, "expected_version": 0}), "aborted")
    fresh = result(await client.put("/v1/templates/other", headers=operator,
                                    json={**body, "expected_version": 0}))
    assert fresh["outcome"] == "created"

    listed = result(await client.get("/v1/templates", headers=operator), TemplateListOut)
    assert [t["name"] for t in listed["templates"]] == ["kibotos-base", "other"]
    got = result(await client.get("/v1/templates/kibotos-base", headers=operator),
                 TemplateOut)
    assert got == updated["template"]
    node = bearer(await enroll_node(client, operator, "node-a"))
    assert result(await client.get("/v1/templates/kibotos-base", headers=node)) == got
    error(await client.get("/v1/templates", headers=node), "permission_denied")
    error(await client.put("/v1/templates/x", headers=node, json=body), "permission_denied")


@pytest.mark.parametrize("name", ["Base", ".hidden", "a_b", "x" * 64, "-a", "a-", "a..."])
async def test_bad_template_names_are_refused(client: httpx.AsyncClient,
                                              operator: dict[str, str], name: str) -> None:
    body = await upload_set(client, operator)
    resp = await client.put(f"/v1/templates/{name}", json=body, headers=operator)
    assert "invalid template name" in error(resp, "invalid_argument")["message"]
    assert result(await client.get("/v1/templates", headers=operator)) == {"templates": []}


async def test_bad_bodies_are_refused(client: httpx.AsyncClient,
                                      operator: dict[str, str]) -> None:
    body = await upload_set(client, operator)
    cases = [
        ({**body, "image_digest": "sha256:xyz"}, "image_digest"),
        ({**body, "colour": "red"}, "colour"),
        ({k: v for k, v in body.items() if k != "kernel_digest"}, "kernel_digest"),
        ({**body, "source": {"x": "y" * 9000}}, "source"),
    ]
    for bad, field in cases:
        err = error(await client.put("/v1/templates/t", json=bad, headers=operator),
                    "invalid_argument")
        assert field in err["message"]
    # Digests in the wrong order: the kernel is not an ELF file.
    swapped = {**body, "kernel_digest": body["image_digest"],
               "image_digest": body["kernel_digest"]}
    err = error(await client.put("/v1/templates/t", json=swapped, headers=operator),
                "failed_precondition")
    assert "not an ext4 file system" in err["message"]
    # Bare hex is accepted and stored in canonical form.
    bare = {k: v.removeprefix("sha256:") for k, v in body.items()}
    out = result(await client.put("/v1/templates/t", json=bare, headers=operator))
    assert out["template"]["kernel_digest"] == body["kernel_digest"]


async def test_template_writes_are_journaled(client: httpx.AsyncClient,
                                            operator: dict[str, str]) -> None:
    body = await upload_set(client, operator)
    first = result(await client.put("/v1/templates/t", headers=operator,
                                    json={**body, "command_id": "put-t"}))
    replay = result(await client.put("/v1/templates/t", headers=operator,
                                     json={**body, "command_id": "put-t"}))
    assert replay == first
    kernel2 = kernel_blob(b"2")
    await upload(client, operator, kernel2)
    other = {**body, "kernel_digest": digest(kernel2)}
    err = error(await client.put("/v1/templates/t", headers=operator,
                                 json={**other, "command_id": "put-t"}), "already_exists")
    assert err["details"] == {"command_id": "put-t", "operation": "template.put"}

    deleted = result(await client.request("DELETE", "/v1/templates/t", headers=operator,
                                          json={"command_id": "del-t"}), TemplateOut)
    assert deleted["name"] == "t"
    again = result(await client.request("DELETE", "/v1/templates/t", headers=operator,
                                        json={"command_id": "del-t"}))
    assert again == deleted
    error(await client.delete("/v1/templates/t", headers=operator), "not_found")
    error(await client.get("/v1/templates/t", headers=operator), "not_found")


async def test_delete_checks_the_expected_revision(client: httpx.AsyncClient,
                                                   operator: dict[str, str]) -> None:
    body = await upload_set(client, operator)
    result(await client.put("/v1/templates/t", headers=operator, json=body))
    error(await client.request("DELETE", "/v1/templates/t", headers=operator,
                               json={"expected_version": 3}), "aborted")
    result(await client.get("/v1/templates/t", headers=operator))
    result(await client.request("DELETE", "/v1/templates/t", headers=operator,
                                json={"expected_version": 1}))


async def _add_workspace(ctx: CtrlContext, workspace_id: str, template: str,
                         state: str) -> None:
    def txn(session: Session) -> None:
        now = utcnow()
        session.add(Workspace(
            workspace_id=workspace_id, template_name=template,
            image_digest="sha256:" + "1" * 64, kernel_digest="sha256:" + "2" * 64,
            initramfs_digest="sha256:" + "3" * 64, labels={}, state=state, revision=1,
            cpu_millis=1000, memory_bytes=1 << 30, layer_size_bytes=1 << 30,
            layer_pool_id="pool-a", layer_ref=workspace_id, created_at=now,
            updated_at=now))

    await ctx.store.write(txn)


async def test_delete_is_refused_while_a_workspace_uses_it(
        client: httpx.AsyncClient, ctx: CtrlContext, operator: dict[str, str]) -> None:
    body = await upload_set(client, operator)
    result(await client.put("/v1/templates/t", headers=operator, json=body))
    await _add_workspace(ctx, "ws-1", "t", "AVAILABLE")
    await _add_workspace(ctx, "ws-2", "t", "DELETED")
    await _add_workspace(ctx, "ws-3", "other", "AVAILABLE")
    err = error(await client.delete("/v1/templates/t", headers=operator),
                "failed_precondition")
    assert err["details"]["workspaces"] == ["ws-1"]
    assert "ws-1" in err["message"]
    result(await client.get("/v1/templates/t", headers=operator))

    def mark_deleted(session: Session) -> None:
        row = session.get(Workspace, "ws-1")
        assert row is not None
        row.state = "DELETED"

    await ctx.store.write(mark_deleted)
    result(await client.delete("/v1/templates/t", headers=operator))


async def test_zero_runs_are_stored_as_holes(client: httpx.AsyncClient, ctx: CtrlContext,
                                             operator: dict[str, str]) -> None:
    # An ext4 image is mostly zeros; a trailing run of zeros must survive as length.
    data = kernel_blob() + bytes(6 << 20) + b"middle" + bytes(3 << 20)
    await upload(client, operator, data)
    path = blob_dir(ctx) / hashlib.sha256(data).hexdigest()
    assert path.read_bytes() == data
    assert path.stat().st_blocks * 512 < 2 << 20
    assert (await client.get(blob_path(data), headers=operator)).content == data
