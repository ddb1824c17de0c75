"""Build a Template image from a recipe (debootstrap + packages + files), cached twice.

Stage 1, the root file system: ``debootstrap --variant=minbase --include=<packages>
<suite> DIR <mirror>`` (TESTBED: ~50 s, 261 MB; python3-minimal lacks json, asyncio
and ssl, so the default Template takes ``python3``), with apt's downloaded packages and
lists removed.  Cached by (suite, variant, packages, mirror).

Stage 2, the image: the rootfs hard-linked into a staging tree, the recipe's files
written over it (each replaced, never written through a shared link), the guest agent's
package byte-compiled by the Template's own ``python3`` (in a chroot, so the bytecode
matches the guest's Python version), then ``mkfs.ext4 -d`` into a sparse image without
journal (the guest mounts it read-only).  Cached by (stage 1 key, file digests, modes,
bytecode revision), so a new agent costs seconds, not a debootstrap.

The agent is the launcher ``/usr/lib/kibotos-guest/agent.py`` and the package
``/usr/lib/kibotos-guest/kibotos_guest/`` beside it (`agent_files`).  Its bytecode is
``checked-hash``: Python checks each module's source hash, not its mtime, so the
image is reproducible and a stale or foreign ``.pyc`` is never used.

Each entry has ``template.json``::

    {"format": 1, "kind": "kibotos-template", "name": "kibotos-base",
     "inputs_digest": "<hex>", "recipe": {"suite", "variant", "packages", "mirror",
     "files": {"/usr/lib/kibotos-guest/agent.py": {"sha256", "mode"},
               "/usr/lib/kibotos-guest/kibotos_guest/<module>.py": {…}, …}},
     "image": {"file": "image", "format": "raw-ext4", "sha256", "size"}}
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import kibotos
from kibotos.core import atomicfile
from kibotos.core.errors import FailedPrecondition, InvalidArgument, KibotosError
from kibotos.platform import debs, images
from kibotos.platform.aptsources import debian_mirror
from kibotos.platform.cache import cached_build, default_cache_root, input_key

FORMAT = 1
MANIFEST = "template.json"
ROOTFS_MANIFEST = "rootfs.json"
BUILDER_REVISION = 1
AGENT_GUEST_DIR = "/usr/lib/kibotos-guest"
AGENT_GUEST_PATH = f"{AGENT_GUEST_DIR}/agent.py"
#: The agent's package, beside its launcher on the host and in the guest.
AGENT_PACKAGE = "kibotos_guest"
#: How the agent's bytecode is made (``compileall --invalidation-mode checked-hash`` by
#: the guest's python3); part of every image's cache key, so a change rebuilds images.
BYTECODE_REVISION = 1
#: The debootstrap program (tests put a fake one here).
DEBOOTSTRAP = "debootstrap"
#: apt's leftovers that only make an image bigger (an install in the guest runs
#: ``apt-get update`` first, as in any container image).
_PRUNE = ("var/cache/apt/archives", "var/lib/apt/lists")


def repo_agent() -> Path:
    """The guest agent's launcher shipped with kibotos (`kibotos/guest/agent.py`)."""
    return Path(kibotos.__file__).parent / "guest" / "agent.py"


def agent_files(agent: Path | None = None) -> dict[str, tuple[Path, int]]:
    """The guest agent as Template files (guest path -> (host file, mode)): the launcher
    `agent` (default `repo_agent`) at `AGENT_GUEST_PATH`, 0755, and the modules of the
    `kibotos_guest` package beside it, 0644.  A launcher without that package beside it
    is installed alone (a single-file agent)."""
    agent = agent or repo_agent()
    files = {AGENT_GUEST_PATH: (agent, 0o755)}
    package = agent.parent / AGENT_PACKAGE
    if package.is_dir():
        for src in sorted(package.rglob("*.py")):
            rel = src.relative_to(package).as_posix()
            files[f"{AGENT_GUEST_DIR}/{AGENT_PACKAGE}/{rel}"] = (src, 0o644)
    return files


def agent_digest(agent: Path | None = None) -> str:
    """The hex sha256 that identifies the installed agent: every file of `agent_files`
    (path, content, mode) and `BYTECODE_REVISION`, for cache keys of images it goes in."""
    files = {dest: {"sha256": debs.sha256_file(src), "mode": mode}
             for dest, (src, mode) in sorted(agent_files(agent).items())}
    return input_key({"files": files, "bytecode": BYTECODE_REVISION})


@dataclass(frozen=True)
class Recipe:
    name: str = "kibotos-base"
    suite: str = "bookworm"
    variant: str = "minbase"
    packages: tuple[str, ...] = ("python3",)
    mirror: str | None = None  # None: the mirror of this machine's apt sources
    #: guest path -> (host file, mode)
    files: dict[str, tuple[Path, int]] = field(default_factory=dict)


def default_recipe(agent: Path | None = None) -> Recipe:
    """``kibotos-base``: Debian minbase + python3 + the guest agent (`agent_files`)."""
    return Recipe(files=agent_files(agent))


def _check(recipe: Recipe) -> None:
    if not recipe.name or len(recipe.name) > 63 or not all(
            c.isalnum() or c in "-._" for c in recipe.name):
        raise InvalidArgument(f"template name {recipe.name!r}: 1-63 letters, digits, '-._'")
    for pkg in recipe.packages:
        if not pkg or not all(c.isalnum() or c in "+-.:" for c in pkg):
            raise InvalidArgument(f"template package name {pkg!r} is not a Debian package name")
    for dest, (src, mode) in recipe.files.items():
        if not dest.startswith("/") or ".." in dest.split("/") or dest.endswith("/"):
            raise InvalidArgument(f"template file destination {dest!r} must be an absolute "
                                  "file path without '..'")
        if not src.is_file():
            raise InvalidArgument(f"template file {dest}: source {src} does not exist")
        if not 0 <= mode <= 0o7777:
            raise InvalidArgument(f"template file {dest}: mode {oct(mode)} out of range")


def _debootstrap(tmp: Path, recipe: Recipe, mirror: str, inputs: dict[str, Any]) -> None:
    rootfs = tmp / "rootfs"
    argv = [DEBOOTSTRAP, f"--variant={recipe.variant}"]
    if recipe.packages:
        argv.append("--include=" + ",".join(recipe.packages))
    argv += [recipe.suite, str(rootfs), mirror]
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C",
           "DEBIAN_FRONTEND": "noninteractive"}
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    except FileNotFoundError:
        raise FailedPrecondition("build template: debootstrap is not installed") from None
    if proc.returncode != 0:
        log = rootfs / "debootstrap" / "debootstrap.log"
        detail = log.read_text(errors="replace")[-1500:] if log.is_file() else proc.stderr
        raise FailedPrecondition(f"build template: debootstrap exited with "
                                 f"{proc.returncode}: {detail.strip()[-1500:]}")
    for rel in _PRUNE:
        d = rootfs / rel
        if d.is_dir():
            for child in d.iterdir():
                if child.is_file() and child.name != "lock":
                    child.unlink()
    atomicfile.write_json(tmp / ROOTFS_MANIFEST, {"format": FORMAT, "inputs": inputs})


def _place_files(stage: Path, files: dict[str, tuple[Path, int]]) -> None:
    for dest, (src, mode) in sorted(files.items()):
        target = stage / dest.lstrip("/")
        parent = target.parent
        # Create missing directories one by one (root-owned, 0755); refuse to follow a
        # symlink out of the tree.
        if not parent.resolve().is_relative_to(stage.resolve()):
            raise InvalidArgument(f"template file {dest}: its directory leaves the rootfs")
        parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            target.unlink()  # never write through a hard link into the cached rootfs
        target.write_bytes(src.read_bytes())
        os.chmod(target, mode)
        os.chown(target, 0, 0)


def _precompile_agent(stage: Path, files: dict[str, tuple[Path, int]]) -> None:
    """Byte-compile the agent's package with the tree's own python3, in a chroot, so the
    ``.pyc`` files match the guest's Python (its magic number and cache tag) and the
    guest imports them instead of compiling the agent at every boot.

    A tree without python3 is left alone (nothing in it could run the agent, and the
    guest init refuses to start it); a compile that fails fails the build."""
    package = f"{AGENT_GUEST_DIR}/{AGENT_PACKAGE}"
    modules = sorted(PurePosixPath(d[len(package) + 1:]) for d in files
                     if d.startswith(package + "/") and d.endswith(".py"))
    if not modules or not os.path.lexists(stage / "usr/bin/python3"):
        return
    pycaches = sorted({stage / package.lstrip("/") / m.parent / "__pycache__"
                       for m in modules})
    for pycache in pycaches:
        if pycache.is_symlink() or pycache.is_file():
            pycache.unlink()
        elif pycache.is_dir():
            shutil.rmtree(pycache)  # bytecode of an older agent (an imported tree):
            #                         unlinked, never rewritten through a link into a cache
    argv = ["chroot", str(stage), "/usr/bin/python3", "-I", "-B", "-m", "compileall", "-q",
            "--invalidation-mode", "checked-hash", package]
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    except FileNotFoundError:
        raise FailedPrecondition("build template: chroot is not installed") from None
    root = stage / package.lstrip("/")
    missing = [str(m) for m in modules
               if not list((root / m.parent / "__pycache__").glob(f"{m.stem}.*.pyc"))]
    if proc.returncode != 0 or missing:
        detail = (proc.stderr or proc.stdout).strip()[-1000:] or f"no bytecode for {missing}"
        raise FailedPrecondition("build template: byte-compiling the guest agent with the "
                                 f"Template's python3 failed: {detail}")
    for pycache in pycaches:
        for pyc in pycache.iterdir():
            os.chmod(pyc, 0o644)
            os.chown(pyc, 0, 0)


def image_from_tree(stage: Path, image: Path, *, name: str,
                    files: dict[str, tuple[Path, int]]) -> None:
    """Write `files` into `stage` (a tree the caller owns; each file replaces its path),
    byte-compile the agent's package among them with the tree's python3, and make the
    read-only Template image.  Shared by recipe builds and ``kibo template import``, so
    both lay out and size images the same way."""
    _place_files(stage, files)
    _precompile_agent(stage, files)
    size, inodes = images.template_size(stage)
    images.create_ext4(image, size, label=name[:16], journal=False, source_dir=stage,
                       inodes=inodes)


def _make_image(tmp: Path, rootfs: Path, recipe: Recipe, inputs: dict[str, Any],
                rootfs_key: str, mirror: str) -> None:
    stage = tmp / "stage"
    try:
        subprocess.run(["cp", "-al", str(rootfs), str(stage)], check=True,
                       capture_output=True)
    except subprocess.CalledProcessError as exc:
        raise FailedPrecondition(f"build template: stage rootfs: {exc.stderr.decode()}"
                                 ) from None
    image = tmp / "image"
    try:
        image_from_tree(stage, image, name=recipe.name, files=recipe.files)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    atomicfile.write_json(tmp / MANIFEST, {
        "format": FORMAT,
        "kind": "kibotos-template",
        "name": recipe.name,
        "inputs_digest": input_key(inputs),
        "rootfs_digest": rootfs_key,
        "recipe": {"suite": recipe.suite, "variant": recipe.variant,
                   "packages": list(recipe.packages), "mirror": mirror,
                   "files": inputs["files"]},
        "image": {"file": "image", "format": "raw-ext4", "size": image.stat().st_size,
                  "sha256": debs.sha256_file(image)},
    })


def build_template(recipe: Recipe, *, cache_root: Path | None = None) -> Path:
    """The Template directory (``image`` + ``template.json``) for `recipe`."""
    _check(recipe)
    mirror = recipe.mirror or debian_mirror(recipe.suite)
    root = cache_root or default_cache_root()
    rootfs_inputs = {"builder": BUILDER_REVISION, "suite": recipe.suite,
                     "variant": recipe.variant, "packages": sorted(recipe.packages),
                     "mirror": mirror}
    rootfs_key = input_key(rootfs_inputs)
    rootfs_entry = cached_build(
        root / "rootfs", rootfs_key, ROOTFS_MANIFEST,
        lambda tmp: _debootstrap(tmp, recipe, mirror, rootfs_inputs))
    files = {dest: {"sha256": debs.sha256_file(src), "mode": mode}
             for dest, (src, mode) in sorted(recipe.files.items())}
    inputs = {"builder": BUILDER_REVISION, "rootfs": rootfs_key, "name": recipe.name,
              "files": files, "bytecode": BYTECODE_REVISION}
    return cached_build(
        root / "templates", input_key(inputs), MANIFEST,
        lambda tmp: _make_image(tmp, rootfs_entry / "rootfs", recipe, inputs, rootfs_key,
                                mirror))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="packaging/template/build.sh",
        description="Build (or find in the cache) a kibotos Template image.")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--name", default="kibotos-base")
    parser.add_argument("--suite", default="bookworm")
    parser.add_argument("--package", action="append", default=None,
                        help="packages to include (repeatable; default: python3)")
    parser.add_argument("--mirror", default=None,
                        help="Debian mirror (default: the one in this machine's apt sources)")
    parser.add_argument("--agent", type=Path, default=None,
                        help=f"guest agent launcher to install at {AGENT_GUEST_PATH}, "
                             f"with the {AGENT_PACKAGE} package beside it "
                             "(default: kibotos/guest/agent.py)")
    parser.add_argument("--file", action="append", default=[], metavar="SRC:DEST[:MODE]",
                        help="extra file to copy into the image (repeatable)")
    args = parser.parse_args(argv)
    try:
        base = default_recipe(args.agent)
        files = dict(base.files)
        for spec in args.file:
            parts = spec.split(":")
            if len(parts) not in (2, 3):
                raise InvalidArgument(f"--file {spec!r}: expected SRC:DEST[:MODE]")
            mode = int(parts[2], 8) if len(parts) == 3 else 0o644
            files[parts[1]] = (Path(parts[0]), mode)
        recipe = Recipe(name=args.name, suite=args.suite,
                        packages=tuple(args.package or base.packages),
                        mirror=args.mirror, files=files)
        path = build_template(recipe, cache_root=args.cache_dir)
    except (KibotosError, ValueError) as exc:
        print(f"error: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return getattr(exc, "exit_code", 10)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
