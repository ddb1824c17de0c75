"""``kibo template``: make Templates and publish them to ctrl; list, get, delete them.

``build`` and ``import`` make the three blobs on this machine (`template_images`),
upload the ones ctrl's artifact store lacks (``HEAD``, then a streamed ``PUT``), and
point the Template name at them (``PUT /v1/templates/NAME``).  Each step can be run
again: the images are cached by their inputs, uploads are skipped for blobs ctrl has,
and pointing a name at the blobs it already has changes nothing.  Arguments are checked
before anything is built or sent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

import click

from kibotos._version import __version__
from kibotos.cli.core.options import (
    Invocation,
    check_command_id,
    kibo_options,
    versioned_write_options,
)
from kibotos.cli.core.output import Section, dash
from kibotos.cli.workspace import template_images
from kibotos.cli.workspace.template_images import Blob, Made
from kibotos.core import ids
from kibotos.core.errors import InvalidArgument
from kibotos.core.units import format_bytes
from kibotos.platform.cache import default_cache_root


@click.group("template")
def template_group() -> None:
    """Build, import, list, show and delete Templates."""


def template_path(name: str) -> str:
    return f"/v1/templates/{quote(name, safe='')}"


def short(digest: object) -> str:
    """``sha256:0123456789ab`` — enough to tell blobs apart in a table."""
    return dash(digest)[:19]


def _platform_option(fn: Any) -> Any:
    return click.option(
        "--platform", "platform_dir", type=click.Path(path_type=Path), metavar="DIR",
        help="Platform directory (vmlinux, initramfs); default: build or find it with "
             "the Platform builder.")(fn)


def _cache_option(fn: Any) -> Any:
    return click.option(
        "--cache-dir", type=click.Path(path_type=Path), metavar="DIR",
        help="Build cache (default: $KIBOTOS_CACHE_DIR, /var/cache/kibotos as root, "
             "~/.cache/kibotos otherwise).")(fn)


def _check_dir(path: Path | None, what: str) -> None:
    if path is not None and not path.is_dir():
        raise InvalidArgument(f"{what} {path} is not a directory")


def _publish(inv: Invocation, name: str, made: Made, command_id: str | None,
             expected_version: int | None) -> None:
    client = inv.client()
    uploaded = []
    for what, blob in (("image", made.image), ("kernel", made.kernel),
                       ("initramfs", made.initramfs)):
        path = f"/v1/artifacts/sha256/{ids.digest_hex(blob.digest)}"
        if client.exists(path):
            inv.out.message(f"{what} {short(blob.digest)}: already in ctrl's store")
            continue
        inv.out.message(f"{what} {short(blob.digest)}: uploading {format_bytes(blob.size)}")
        client.put_file(path, blob.path)
        uploaded.append(blob.digest)
    body = {"image_digest": made.image.digest, "kernel_digest": made.kernel.digest,
            "initramfs_digest": made.initramfs.digest,
            "source": {**made.source, "made_by": f"kibo {__version__}"},
            "command_id": command_id, "expected_version": expected_version}
    result = client.put(template_path(name), body)
    if inv.as_json:
        inv.out.json_result({**result, "uploaded": uploaded})
        return
    tpl = result.get("template") or {}
    inv.out.line(f"template {name}: {result.get('outcome')}, revision {tpl.get('revision')} "
                 f"(image {short(made.image.digest)}, {format_bytes(made.image.size)}; "
                 f"{len(uploaded)} blob(s) uploaded)")


def _with_platform(image: Blob, source: dict[str, Any], platform_dir: Path | None,
                   cache_root: Path) -> Made:
    kernel, initramfs, platform = template_images.platform_blobs(platform_dir, cache_root)
    return Made(image=image, kernel=kernel, initramfs=initramfs,
                source={**source, "platform": platform})


# ---------------------------------------------------------------------------- build


@template_group.command("build")
@click.argument("name")
@click.option("--recipe", "recipe_path", type=click.Path(path_type=Path), required=True,
              metavar="FILE", help="Recipe (TOML: suite, variant, packages, mirror, files).")
@_platform_option
@_cache_option
@versioned_write_options
def build(inv: Invocation, name: str, recipe_path: Path, platform_dir: Path | None,
          cache_dir: Path | None, command_id: str | None,
          expected_version: int | None) -> None:
    """Build a Template from a recipe (debootstrap + packages + files) and publish it."""
    ids.check_template_name(name)
    check_command_id(command_id)
    _check_dir(platform_dir, "--platform")
    cache_root = cache_dir or default_cache_root()
    recipe = template_images.load_recipe(recipe_path, name, cache_root)
    inv.load_config()  # a missing kibo.toml stops us before a long build
    inv.out.message(f"building template {name} ({recipe.suite}, "
                    f"{', '.join(recipe.packages) or 'no extra packages'})")
    image, source = template_images.build_image(recipe, cache_root)
    _publish(inv, name, _with_platform(image, source, platform_dir, cache_root), command_id,
             expected_version)


# ---------------------------------------------------------------------------- import


@template_group.command("import")
@click.argument("name")
@click.option("--rootfs", "tarball", type=click.Path(path_type=Path), required=True,
              metavar="TARBALL", help="Root file system as a tar archive (plain, gzip, xz, "
                                      "bzip2 or zstd).")
@_platform_option
@_cache_option
@versioned_write_options
def import_(inv: Invocation, name: str, tarball: Path, platform_dir: Path | None,
            cache_dir: Path | None, command_id: str | None,
            expected_version: int | None) -> None:
    """Make a Template from a rootfs tarball (the agent added) and publish it."""
    ids.check_template_name(name)
    check_command_id(command_id)
    _check_dir(platform_dir, "--platform")
    if not tarball.is_file():
        raise InvalidArgument(f"--rootfs {tarball} is not a file")
    cache_root = cache_dir or default_cache_root()
    inv.load_config()
    inv.out.message(f"importing template {name} from {tarball}")
    image, source = template_images.import_image(tarball, name, cache_root)
    _publish(inv, name, _with_platform(image, source, platform_dir, cache_root), command_id,
             expected_version)


# ---------------------------------------------------------------------------- reads

LIST_COLUMNS = ("NAME", "REVISION", "IMAGE", "SIZE", "KERNEL", "UPDATED")


@template_group.command("list")
@kibo_options
def list_templates(inv: Invocation) -> None:
    """List Templates, one row each."""
    inv.list_table("/v1/templates", "templates", LIST_COLUMNS, _list_row)


def _list_row(t: dict[str, Any]) -> tuple[str, ...]:
    return (dash(t.get("name")), dash(t.get("revision")),
            short((t.get("image") or {}).get("digest")),
            format_bytes(int((t.get("image") or {}).get("size") or 0)),
            short(t.get("kernel_digest")), dash(t.get("updated_at")))


def _sections(t: dict[str, Any]) -> list[Section]:
    main = Section(f"Template {t.get('name')}")
    main.add_fields(t, {"Revision": "revision", "Created": "created_at", "Updated": "updated_at"})
    blobs = Section("Blobs")
    image = t.get("image") or {}
    blobs.add("Image", f"{dash(image.get('digest'))} "
                       f"({format_bytes(int(image.get('size') or 0))})")
    blobs.add("Kernel", dash(t.get("kernel_digest")))
    blobs.add("Initramfs", dash(t.get("initramfs_digest")))
    out = [main, blobs]
    source = t.get("source") or {}
    if source:
        made = Section("Made from")
        made.add("Kind", dash(source.get("kind")))
        recipe = source.get("recipe") or {}
        if recipe:
            made.add("Suite", dash(recipe.get("suite")))
            made.add("Packages", ", ".join(recipe.get("packages") or []) or "-")
        tar = source.get("tarball") or {}
        if tar:
            made.add("Tarball", f"{dash(tar.get('name'))} (sha256:{dash(tar.get('sha256'))})")
        made.add("Kernel release", dash((source.get("platform") or {}).get("kernel")))
        made.add("Made by", dash(source.get("made_by")))
        out.append(made)
    return out


@template_group.command("get")
@click.argument("name")
@kibo_options
def get_template(inv: Invocation, name: str) -> None:
    """Show one Template: its blobs and what it was made from."""
    ids.check_template_name(name)
    result = inv.client().get(template_path(name))
    inv.out.result(result, lambda: inv.out.sections(_sections(result)))


@template_group.command("delete")
@click.argument("name")
@versioned_write_options
def delete_template(inv: Invocation, name: str, command_id: str | None,
                    expected_version: int | None) -> None:
    """Delete a Template no Workspace uses (its blobs stay in ctrl's store)."""
    ids.check_template_name(name)
    check_command_id(command_id)
    result = inv.client().delete(template_path(name), {
        "command_id": command_id, "expected_version": expected_version})
    if inv.as_json:
        inv.out.json_result(result)
    else:
        inv.out.line(f"deleted template {name} (revision {result.get('revision')})")
