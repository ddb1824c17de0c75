"""Where `kibo template build|import` gets a Template's three blobs on this machine.

* **Platform** (``vmlinux`` + ``initramfs``): the directory given with ``--platform``,
  else the one `kibotos.platform.build_platform` builds or finds in its cache.
* **Image from a recipe**: the TOML recipe becomes a `build_template.Recipe`, so the
  Template builder's two caches apply (debootstrap once per suite and packages, the
  image once per file set): an unchanged rebuild is a lookup.
* **Image from a rootfs tarball** (plain, gzip, xz, bzip2 or zstd): unpacked as root with
  owners and modes kept, the agent added at ``/usr/lib/kibotos-guest/``, and made into an
  image by the builder's own `image_from_tree`; cached by (tarball digest, agent
  digest, name) the same way.

A recipe::

    suite = "bookworm"               # required
    variant = "minbase"              # default minbase
    packages = ["python3"]           # default ["python3"]: the agent needs it
    mirror = "http://deb.example/debian"   # default: this machine's apt source
    [files."/etc/motd"]
    content = "hello\\n"             # or source = "motd" (relative to the recipe)
    mode = "0644"

The guest agent is always installed: its launcher at ``/usr/lib/kibotos-guest/agent.py``
(0755) and its package, byte-compiled, in ``/usr/lib/kibotos-guest/kibotos_guest/``
(`build_template.agent_files`).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import lzma
import os
import shutil
import tarfile
import tomllib
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any

import zstandard

from kibotos.core import atomicfile
from kibotos.core.errors import FailedPrecondition, InvalidArgument
from kibotos.platform import build_template as bt
from kibotos.platform.build_platform import build_platform
from kibotos.platform.cache import cached_build, input_key
from kibotos.platform.debs import sha256_file

IMPORT_REVISION = 1
IMPORT_MANIFEST = "template.json"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_RECIPE_KEYS = {"suite", "variant", "packages", "mirror", "files"}
_FILE_KEYS = {"source", "content", "mode"}


@dataclass(frozen=True)
class Blob:
    path: Path
    digest: str  # sha256:<hex>
    size: int


@dataclass(frozen=True)
class Made:
    """A Template's blobs on this machine, and what to record about their inputs."""

    image: Blob
    kernel: Blob
    initramfs: Blob
    source: dict[str, Any]


def _blob(path: Path, sha256: str | None = None) -> Blob:
    return Blob(path, f"sha256:{sha256 or sha256_file(path)}", path.stat().st_size)


# ------------------------------------------------------------------------- platform


def platform_blobs(platform_dir: Path | None, cache_root: Path | None
                   ) -> tuple[Blob, Blob, dict[str, Any]]:
    """(kernel, initramfs, description) of the given or the built Platform."""
    if platform_dir is None:
        platform_dir = build_platform(cache_root=cache_root)
    vmlinux, initramfs = platform_dir / "vmlinux", platform_dir / "initramfs"
    for path in (vmlinux, initramfs):
        if not path.is_file():
            raise InvalidArgument(f"--platform {platform_dir}: {path.name} is missing "
                                  "(a Platform directory has vmlinux and initramfs)")
    described: dict[str, Any] = {"dir": str(platform_dir)}
    files: dict[str, Any] = {}
    manifest = platform_dir / "platform.json"
    if manifest.is_file():
        data = json.loads(manifest.read_text())
        files = data.get("files") or {}
        described = {"inputs_digest": data.get("inputs_digest"),
                     "kernel": (data.get("kernel") or {}).get("release"),
                     "initramfs_compression": data.get("initramfs_compression")}
    # The builder's manifest names each file's digest; trust it only for its own files.
    kernel = _blob(vmlinux, (files.get("vmlinux") or {}).get("sha256"))
    initrd = _blob(initramfs, (files.get("initramfs") or {}).get("sha256"))
    return kernel, initrd, described


# --------------------------------------------------------------------------- recipe


def _mode(value: Any, where: str) -> int:
    try:
        mode = int(value, 8) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        raise InvalidArgument(f"{where}: mode {value!r} is not an octal number") from None
    if not 0 <= mode <= 0o7777:
        raise InvalidArgument(f"{where}: mode {oct(mode)} is out of range")
    return mode


def _content_file(text: str, cache_root: Path) -> Path:
    """Inline content as a file the builder can copy (named by its digest)."""
    data = text.encode()
    path = cache_root / "recipe-files" / f"sha256-{hashlib.sha256(data).hexdigest()}"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        atomicfile.write_bytes(path, data)
    return path


def load_recipe(path: Path, name: str, cache_root: Path) -> bt.Recipe:
    """The recipe in `path` for Template `name`; every bad key is named."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise InvalidArgument(f"recipe {path} does not exist") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise InvalidArgument(f"recipe {path} is not readable TOML: {exc}") from None
    unknown = sorted(set(data) - _RECIPE_KEYS)
    if unknown:
        raise InvalidArgument(f"recipe {path}: unknown key {', '.join(unknown)} "
                              f"(known: {', '.join(sorted(_RECIPE_KEYS))})")
    suite, variant = data.get("suite"), data.get("variant", "minbase")
    packages, mirror = data.get("packages", ["python3"]), data.get("mirror")
    if not isinstance(suite, str) or not suite:
        raise InvalidArgument(f"recipe {path}: suite is required (e.g. \"bookworm\")")
    if not isinstance(variant, str) or not isinstance(packages, list) or not all(
            isinstance(p, str) for p in packages):
        raise InvalidArgument(f"recipe {path}: variant must be a string and packages a "
                              "list of strings")
    if mirror is not None and not isinstance(mirror, str):
        raise InvalidArgument(f"recipe {path}: mirror must be a URL string")
    files: dict[str, tuple[Path, int]] = bt.agent_files()
    table = data.get("files", {})
    if not isinstance(table, dict):
        raise InvalidArgument(f"recipe {path}: files must be a table of tables")
    for dest, spec in table.items():
        where = f"recipe {path}: files.{json.dumps(dest)}"
        if not isinstance(spec, dict) or set(spec) - _FILE_KEYS or (
                ("source" in spec) == ("content" in spec)):
            raise InvalidArgument(f"{where}: give exactly one of source or content "
                                  "(and optionally mode)")
        if "source" in spec:
            src = (path.parent / str(spec["source"])).resolve()
        else:
            src = _content_file(str(spec["content"]), cache_root)
        files[str(dest)] = (src, _mode(spec.get("mode", "0644"), where))
    return bt.Recipe(name=name, suite=suite, variant=variant, packages=tuple(packages),
                     mirror=mirror, files=files)


def build_image(recipe: bt.Recipe, cache_root: Path) -> tuple[Blob, dict[str, Any]]:
    if os.geteuid() != 0:
        raise FailedPrecondition("kibo template build runs as root: debootstrap makes a "
                                 "root-owned tree, and the recipe's files are root-owned")
    entry = bt.build_template(recipe, cache_root=cache_root)
    manifest = json.loads((entry / bt.MANIFEST).read_text())
    image = _blob(entry / "image", manifest["image"]["sha256"])
    return image, {"kind": "recipe", "inputs_digest": manifest["inputs_digest"],
                   "recipe": {k: manifest["recipe"][k]
                              for k in ("suite", "variant", "packages", "mirror")}}


# --------------------------------------------------------------------------- import


def _member_path(name: str, what: str) -> PurePosixPath:
    rel = PurePosixPath(name.lstrip("/"))
    if ".." in rel.parts:
        raise InvalidArgument(f"rootfs tarball: {what} {name!r} leaves the tree ('..')")
    return rel


def _no_symlink_parents(dest: Path, rel: PurePosixPath, name: str) -> None:
    """Refuse a path that would be written through a symbolic link made earlier in the
    archive (``etc -> /etc`` then ``etc/passwd`` would write the host's file)."""
    current = dest
    for part in rel.parts[:-1]:
        current = current / part
        if current.is_symlink():
            raise InvalidArgument(f"rootfs tarball: {name!r} goes through the symbolic "
                                  f"link /{current.relative_to(dest)}")


def _filter(member: tarfile.TarInfo, dest_path: str) -> tarfile.TarInfo | None:
    """Keep owners, modes (setuid, sticky) and links as the archive has them, but never
    write outside the tree."""
    dest = Path(dest_path)
    rel = _member_path(member.name, "member")
    if rel.parts in ((), (".",)):
        return None  # the archive's own root entry
    _no_symlink_parents(dest, rel, member.name)
    if member.islnk():
        target = _member_path(member.linkname, "hard link target")
        _no_symlink_parents(dest, target, member.linkname)
        return member.replace(name=str(rel), linkname=str(target), deep=False)
    return member.replace(name=str(rel), deep=False)


def _open_tarball(raw: IO[bytes]) -> tuple[tarfile.TarFile, str]:
    head = raw.read(4)
    raw.seek(0)
    if head == ZSTD_MAGIC:
        stream = zstandard.ZstdDecompressor().stream_reader(raw)
        return tarfile.open(fileobj=stream, mode="r|"), "zstd"
    return tarfile.open(fileobj=raw, mode="r|*"), "auto"


#: What a damaged or foreign file raises while it is decompressed and read as tar.
_DAMAGED = (tarfile.TarError, EOFError, zstandard.ZstdError, gzip.BadGzipFile,
            lzma.LZMAError, zlib.error)


def unpack(tarball: Path, dest: Path) -> str:
    """Unpack `tarball` into the new directory `dest`; returns its compression."""
    dest.mkdir(mode=0o755)
    with open(tarball, "rb") as raw:
        try:
            tar, compression = _open_tarball(raw)
            with tar:
                tar.extractall(dest, numeric_owner=True, filter=_filter)
        except _DAMAGED as exc:
            raise InvalidArgument(
                f"rootfs tarball {tarball} is not a readable tar archive (plain, gzip, "
                f"xz, bzip2 or zstd): {exc}") from None
        except OSError as exc:
            raise FailedPrecondition(f"unpack rootfs tarball {tarball}: {exc}") from None
    os.chmod(dest, 0o755)
    return compression


def import_image(tarball: Path, name: str, cache_root: Path) -> tuple[Blob, dict[str, Any]]:
    """The Template image of a rootfs tarball with the agent added, cached."""
    if os.geteuid() != 0:
        raise FailedPrecondition("kibo template import runs as root: the image keeps the "
                                 "tarball's file owners (root:root for most of a rootfs)")
    agent = bt.agent_files()
    tar_digest = sha256_file(tarball)
    inputs = {"builder": IMPORT_REVISION, "tarball": tar_digest, "name": name,
              "agent": bt.agent_digest()}
    key = input_key(inputs)

    def make(tmp: Path) -> None:
        stage = tmp / "stage"
        try:
            compression = unpack(tarball, stage)
            bt.image_from_tree(stage, tmp / "image", name=name, files=agent)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        atomicfile.write_json(tmp / IMPORT_MANIFEST, {
            "format": 1, "kind": "kibotos-template-import", "name": name,
            "inputs_digest": key, "tarball": {"sha256": tar_digest, "name": tarball.name,
                                              "compression": compression},
            "image": {"file": "image", "format": "raw-ext4",
                      "size": (tmp / "image").stat().st_size,
                      "sha256": sha256_file(tmp / "image")}})

    entry = cached_build(cache_root / "imports", key, IMPORT_MANIFEST, make)
    manifest = json.loads((entry / IMPORT_MANIFEST).read_text())
    image = _blob(entry / "image", manifest["image"]["sha256"])
    return image, {"kind": "import", "inputs_digest": key, "tarball": manifest["tarball"]}
