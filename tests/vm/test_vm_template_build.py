"""Template images: ext4 helpers, apt sources, package resolution, and the two-stage
cached Template build (with a stand-in debootstrap, so it runs in seconds)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from kibotos.core.errors import FailedPrecondition, InvalidArgument
from kibotos.platform import build_template as bt
from kibotos.platform import debs
from kibotos.platform.aptsources import apt_sources, debian_mirror
from kibotos.platform.images import create_ext4, create_writable_layer, read_file

needs_e2fs = pytest.mark.skipif(
    shutil.which("mkfs.ext4", path="/usr/sbin:/sbin:/usr/bin:/bin") is None
    or shutil.which("debugfs", path="/usr/sbin:/sbin:/usr/bin:/bin") is None,
    reason="needs e2fsprogs")

# ----------------------------------------------------------------------------- images


@needs_e2fs
def test_writable_layer_is_sparse_ext4(tmp_path: Path):
    img = tmp_path / "rw.img"
    create_writable_layer(img, 1 << 30)
    st = img.stat()
    assert st.st_size == 1 << 30
    assert st.st_blocks * 512 < 64 << 20  # lazy init: metadata only
    assert img.read_bytes()[1080:1082] == b"\x53\xef"  # ext4 superblock magic
    with pytest.raises(FileNotFoundError):
        read_file(img, "/nothing")
    with pytest.raises(FailedPrecondition, match="already exists"):
        create_writable_layer(img, 1 << 30)
    with pytest.raises(InvalidArgument, match="whole number of MiB"):
        create_writable_layer(tmp_path / "odd.img", 1000)
    assert not (tmp_path / "odd.img").exists()


@needs_e2fs
def test_image_from_a_directory_reads_back_without_mounting(tmp_path: Path):
    src = tmp_path / "src"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "greeting").write_text("hello\n")
    img = tmp_path / "t.img"
    create_ext4(img, 32 << 20, label="kibotos-base", journal=False, source_dir=src)
    assert read_file(img, "/etc/greeting") == b"hello\n"
    with pytest.raises(InvalidArgument, match="longer than 16 bytes"):
        create_ext4(tmp_path / "x.img", 32 << 20, label="a-much-too-long-label")


# ----------------------------------------------------------------------------- apt


def test_mirror_from_one_line_and_deb822_sources(tmp_path: Path):
    etc = tmp_path / "apt"
    (etc / "sources.list.d").mkdir(parents=True)
    (etc / "sources.list").write_text(
        "# comment\ndeb-src http://src.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://one.example/debian/ trixie main contrib\n")
    (etc / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://off.example/debian\nSuites: bookworm\nComponents: main\n"
        "Enabled: no\n\n"
        "Types: deb deb-src\n# a comment inside\nURIs: http://deb.example/debian\n"
        "Suites: bookworm bookworm-updates\nComponents: main\n\n"
        "Types: deb\nURIs: http://sec.example/debian-security\nSuites: bookworm-security\n"
        "Components: main\n")
    (etc / "sources.list.d" / "other.list.disabled").write_text("deb http://x/ bookworm main\n")
    assert debian_mirror("trixie", etc) == "http://one.example/debian"
    assert debian_mirror("bookworm", etc) == "http://deb.example/debian"
    assert len(apt_sources(etc)) == 3
    with pytest.raises(FailedPrecondition, match="no apt source for suite 'sid'"):
        debian_mirror("sid", etc)


def _fake_apt_cache(tmp_path: Path, monkeypatch, stanzas: dict[str, str]) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = ["#!/bin/sh", 'shift; shift', 'for p in "$@"; do case "$p" in']
    for name, text in stanzas.items():
        script.append(f"  {name}) cat <<'EOF'\n{text}\nEOF\n  echo ;;")
    script.append("esac; done")
    (bin_dir / "apt-cache").write_text("\n".join(script) + "\n")
    (bin_dir / "apt-cache").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


def test_resolve_follows_the_kernel_metapackage(tmp_path: Path, monkeypatch):
    _fake_apt_cache(tmp_path, monkeypatch, {
        "linux-image-amd64": "Package: linux-image-amd64\nVersion: 6.1.1-1\n"
                             "Depends: linux-image-6.1.0-9-amd64 (= 6.1.1-1)\nSHA256: aa",
        "linux-image-6.1.0-9-amd64": "Package: linux-image-6.1.0-9-amd64\nVersion: 6.1.1-1\n"
                                     "Depends: kmod, linux-base (>= 4.3~)\nSHA256: bb",
        "tini": "Package: tini\nVersion: 0.19\nSHA256: cc",
    })
    refs = debs.resolve("linux-image-amd64", "tini")
    assert refs["linux-image-amd64"] == debs.DebRef("linux-image-6.1.0-9-amd64", "6.1.1-1",
                                                    "bb")
    assert refs["tini"] == debs.DebRef("tini", "0.19", "cc")
    with pytest.raises(FailedPrecondition, match="apt knows no package nope"):
        debs.resolve("nope")


# ----------------------------------------------------------------------------- template

FAKE_DEBOOTSTRAP = """#!/bin/sh
# Stand-in for debootstrap: records its arguments, makes a tiny root file system.
echo "$@" >> {log}
eval "target=\\${{$(($# - 1))}}"
mkdir -p "$target/etc" "$target/usr/bin" "$target/var/cache/apt/archives" \\
    "$target/var/lib/apt/lists/partial"
echo "PRETTY_NAME=fake" > "$target/etc/os-release"
echo shared > "$target/usr/bin/shared"
echo deb > "$target/var/cache/apt/archives/x.deb"
echo list > "$target/var/lib/apt/lists/x_Packages"
"""


@needs_e2fs
def test_template_build_is_cached_in_two_stages(tmp_path: Path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("the Template build chowns the files it adds to root")
    log = tmp_path / "debootstrap.log"
    fake = tmp_path / "debootstrap"
    fake.write_text(FAKE_DEBOOTSTRAP.format(log=log))
    fake.chmod(0o755)
    monkeypatch.setattr(bt, "DEBOOTSTRAP", str(fake))
    agent = tmp_path / "agent.py"
    agent.write_text("print('agent v1')\n")
    recipe = bt.Recipe(mirror="http://mirror.example/debian",
                       files={bt.AGENT_GUEST_PATH: (agent, 0o755),
                              "/usr/bin/shared": (agent, 0o644)})
    cache = tmp_path / "cache"

    out = bt.build_template(recipe, cache_root=cache)
    manifest = json.loads((out / "template.json").read_text())
    assert manifest["name"] == "kibotos-base"
    assert manifest["recipe"]["packages"] == ["python3"]
    args = log.read_text().split()
    assert args[:3] == ["--variant=minbase", "--include=python3", "bookworm"]
    assert args[3].endswith("/rootfs")
    assert args[4] == "http://mirror.example/debian"
    image = out / "image"
    assert read_file(image, bt.AGENT_GUEST_PATH) == b"print('agent v1')\n"
    assert read_file(image, "/etc/os-release") == b"PRETTY_NAME=fake\n"
    with pytest.raises(FileNotFoundError):
        read_file(image, "/var/cache/apt/archives/x.deb")  # apt leftovers pruned
    # The file replaced in the image did not change the cached rootfs (no write
    # through the hard link of the staging tree).
    rootfs = next((cache / "rootfs").glob("sha256-*")) / "rootfs"
    assert (rootfs / "usr/bin/shared").read_text() == "shared\n"

    # Unchanged: instant, no debootstrap, no new image.
    assert bt.build_template(recipe, cache_root=cache) == out
    assert len(log.read_text().splitlines()) == 1
    # A new agent: a new image from the cached rootfs.
    agent.write_text("print('agent v2')\n")
    out2 = bt.build_template(recipe, cache_root=cache)
    assert out2 != out
    assert read_file(out2 / "image", bt.AGENT_GUEST_PATH) == b"print('agent v2')\n"
    assert len(log.read_text().splitlines()) == 1


def test_bad_recipes_are_refused_before_anything_runs(tmp_path: Path):
    agent = tmp_path / "agent.py"
    agent.write_text("")
    cases = [
        (bt.Recipe(name="no spaces"), "template name"),
        (bt.Recipe(packages=("python3;rm",)), "not a Debian package name"),
        (bt.Recipe(files={"relative/x": (agent, 0o644)}), "absolute file path"),
        (bt.Recipe(files={"/a/../b": (agent, 0o644)}), "without '..'"),
        (bt.Recipe(files={"/x": (tmp_path / "missing", 0o644)}), "does not exist"),
    ]
    for recipe, message in cases:
        with pytest.raises(InvalidArgument, match=message):
            bt.build_template(recipe, cache_root=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_failing_debootstrap_reports_its_output(tmp_path: Path, monkeypatch):
    fake = tmp_path / "debootstrap"
    fake.write_text("#!/bin/sh\necho 'E: Could not download Release' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(bt, "DEBOOTSTRAP", str(fake))
    with pytest.raises(FailedPrecondition, match="Could not download Release"):
        bt.build_template(bt.Recipe(mirror="http://m.example/debian"),
                          cache_root=tmp_path / "cache")
    assert not list((tmp_path / "cache" / "rootfs").glob("sha256-*"))
