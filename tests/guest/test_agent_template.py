"""How the agent goes into a Template image: its files, the digest that keys image
caches, and its bytecode, compiled by the image's own python3 in a chroot.

The chroot tree is Debian's python3.11 of this machine hard-linked into a temporary
directory (the same interpreter a ``kibotos-base`` image carries), so the real compile
step runs in a second instead of a debootstrap.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kibotos.core.errors import FailedPrecondition
from kibotos.guest import AGENT_PACKAGE_DIR, AGENT_PATH
from kibotos.platform import build_template as bt
from kibotos.platform.images import read_file

PACKAGE = f"{bt.AGENT_GUEST_DIR}/{bt.AGENT_PACKAGE}"
GUEST_PY = Path("/usr/bin/python3.11")

needs_chroot_python = pytest.mark.skipif(
    os.geteuid() != 0 or not GUEST_PY.exists() or shutil.which("mkfs.ext4", path=(
        "/usr/sbin:/sbin:/usr/bin:/bin")) is None,
    reason="needs root (chroot), Debian's /usr/bin/python3.11 and e2fsprogs")


def test_agent_files_are_the_launcher_and_every_module() -> None:
    files = bt.agent_files()
    assert files[bt.AGENT_GUEST_PATH] == (AGENT_PATH, 0o755)
    modules = {f"{PACKAGE}/{p.relative_to(AGENT_PACKAGE_DIR).as_posix()}": (p, 0o644)
               for p in AGENT_PACKAGE_DIR.rglob("*.py")}
    assert {k: v for k, v in files.items() if k != bt.AGENT_GUEST_PATH} == modules
    assert f"{PACKAGE}/__init__.py" in files
    assert f"{PACKAGE}/runtime/framing.py" in files  # the tree, not only the top
    assert bt.default_recipe().files == files


def test_the_agent_digest_covers_the_whole_package(tmp_path: Path) -> None:
    copy = tmp_path / "guest"
    copy.mkdir()
    shutil.copy(AGENT_PATH, copy / "agent.py")
    shutil.copytree(AGENT_PACKAGE_DIR, copy / bt.AGENT_PACKAGE,
                    ignore=shutil.ignore_patterns("__pycache__"))
    digest = bt.agent_digest(copy / "agent.py")
    assert digest == bt.agent_digest()
    module = copy / bt.AGENT_PACKAGE / "stop.py"
    module.write_text(module.read_text() + "\n# changed\n")
    assert bt.agent_digest(copy / "agent.py") != digest
    # A launcher alone (no package beside it) is a single-file agent.
    alone = tmp_path / "alone.py"
    alone.write_text("print('agent')\n")
    assert bt.agent_files(alone) == {bt.AGENT_GUEST_PATH: (alone, 0o755)}


def _python_tree(root: Path) -> Path:
    """A chroot-able tree with this machine's Debian python3.11, hard-linked."""
    stage = root / "stage"
    for rel in ("usr/bin", "usr/lib", "tmp"):
        (stage / rel).mkdir(parents=True)
    os.link(GUEST_PY, stage / "usr/bin/python3.11")
    (stage / "usr/bin/python3").symlink_to("python3.11")
    subprocess.run(["cp", "-al", "/usr/lib/python3.11", str(stage / "usr/lib/")], check=True)
    ldd = subprocess.run(["ldd", str(GUEST_PY)], capture_output=True, text=True,
                         check=True).stdout
    for line in ldd.splitlines():
        path = next((w for w in line.split() if w.startswith("/")), None)
        if path is None:
            continue
        dest = stage / path.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.realpath(path), dest)
    return stage


def _pyc_header(data: bytes) -> tuple[bytes, int, bytes]:
    """(magic, flags, source hash) of a hash-based .pyc (PEP 552)."""
    return data[:4], int.from_bytes(data[4:8], "little"), data[8:16]


@needs_chroot_python
def test_the_package_is_byte_compiled_by_the_guest_python(tmp_path: Path) -> None:
    stage = _python_tree(tmp_path)
    image = tmp_path / "image"
    bt.image_from_tree(stage, image, name="agent-test", files=bt.agent_files())

    for src in AGENT_PACKAGE_DIR.rglob("*.py"):
        rel = src.relative_to(AGENT_PACKAGE_DIR).parent.as_posix()
        where = PACKAGE if rel == "." else f"{PACKAGE}/{rel}"
        pyc = read_file(image, f"{where}/__pycache__/{src.stem}.cpython-311.pyc")
        magic, flags, source_hash = _pyc_header(pyc)
        assert magic == importlib.util.MAGIC_NUMBER  # this venv is 3.11 too
        assert flags == 0b11  # hash-based, checked: never used for a changed source
        assert source_hash == importlib.util.source_hash(src.read_bytes()), src.name
    # The guest's python imports the bytecode instead of compiling the sources.
    proc = subprocess.run(
        ["chroot", str(stage), "/usr/bin/python3", "-I", "-v", "-c",
         "import sys; sys.path.insert(0, '/usr/lib/kibotos-guest'); import kibotos_guest.cli"],
        capture_output=True, text=True, check=True)
    assert f"code object from '{PACKAGE}/__pycache__/cli.cpython-311.pyc'" in proc.stderr
    assert (f"code object from '{PACKAGE}/runtime/__pycache__/channel.cpython-311.pyc'"
            in proc.stderr)
    assert f"# wrote '{PACKAGE}" not in proc.stderr


@needs_chroot_python
def test_old_bytecode_in_an_imported_tree_is_replaced(tmp_path: Path) -> None:
    stage = _python_tree(tmp_path)
    stale = stage / PACKAGE.lstrip("/") / "__pycache__"
    stale.mkdir(parents=True)
    (stale / "gone.cpython-311.pyc").write_bytes(b"old agent")
    bt.image_from_tree(stage, tmp_path / "image", name="agent-test", files=bt.agent_files())
    assert not (stale / "gone.cpython-311.pyc").exists()
    assert (stale / "cli.cpython-311.pyc").is_file()


@needs_chroot_python
def test_a_tree_whose_python_cannot_compile_fails_the_build(tmp_path: Path) -> None:
    stage = tmp_path / "stage"
    (stage / "usr/bin").mkdir(parents=True)
    (stage / "usr/bin/python3").write_text("not a program\n")  # not executable either
    with pytest.raises(FailedPrecondition, match="byte-compiling the guest agent"):
        bt.image_from_tree(stage, tmp_path / "image", name="bad", files=bt.agent_files())
    assert not (tmp_path / "image").exists()


@needs_chroot_python
def test_a_tree_without_python_gets_the_sources_only(tmp_path: Path) -> None:
    stage = tmp_path / "stage"
    (stage / "etc").mkdir(parents=True)
    bt.image_from_tree(stage, tmp_path / "image", name="nopython", files=bt.agent_files())
    assert read_file(tmp_path / "image", f"{PACKAGE}/cli.py") == (
        AGENT_PACKAGE_DIR / "cli.py").read_bytes()
    assert not (stage / PACKAGE.lstrip("/") / "__pycache__").exists()
