"""`kibo template` against a real ctrl process: import of small rootfs tarballs (plain and
zstd) into real ext4 images read back with debugfs from ctrl's artifact store, a recipe
build with the builder's stand-in debootstrap (the second build is a cache hit and
uploads nothing), list/get/delete, and bad input refused before anything is written."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import zstandard
from cli_ctrlproc import CtrlProcess
from cli_invoke import invoke

from kibotos.platform import build_template as bt

E2FS_PATH = "/usr/sbin:/sbin:/usr/bin:/bin"
pytestmark = [
    pytest.mark.skipif(shutil.which("mkfs.ext4", path=E2FS_PATH) is None
                       or shutil.which("debugfs", path=E2FS_PATH) is None,
                       reason="needs e2fsprogs"),
    pytest.mark.skipif(os.geteuid() != 0, reason="Template images keep file owners: root"),
]

FAKE_DEBOOTSTRAP = """#!/bin/sh
echo "$@" >> {log}
eval "target=\\${{$(($# - 1))}}"
mkdir -p "$target/etc" "$target/usr/bin"
echo "PRETTY_NAME=fake" > "$target/etc/os-release"
"""


@pytest.fixture(scope="module")
def ctrl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CtrlProcess]:
    proc = CtrlProcess(tmp_path_factory.mktemp("ctrl")).start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def operator(ctrl: CtrlProcess) -> Path:
    path = ctrl.root / "operator" / "kibo.toml"
    result = invoke(None, "enroll", *ctrl.enroll_args(), "--grant",
                    ctrl.grant("operator"), "--config", str(path))
    assert result.exit_code == 0, result.stderr
    return path


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Platform directory as the builder makes it, with small stand-in files."""
    d = tmp_path_factory.mktemp("platform")
    (d / "vmlinux").write_bytes(b"\x7fELF" + os.urandom(4096))
    (d / "initramfs").write_bytes(b"\x1f\x8b" + os.urandom(1024))
    return d


def kibo(config: Path, *args: str):
    return invoke(config, *args)


def kibo_json(config: Path, *args: str):
    result = invoke(config, *args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)["result"]


def debugfs(image: Path, request: str) -> str:
    done = subprocess.run(["debugfs", "-R", request, str(image)], capture_output=True,
                          text=True, env={"PATH": E2FS_PATH}, check=True)
    return done.stdout


def artifact(ctrl: CtrlProcess, digest: str) -> Path:
    return ctrl.state_dir / "artifacts" / "sha256" / digest.removeprefix("sha256:")


def rootfs_tar(compress: bool = False) -> bytes:
    """A tiny root file system whose owners, modes and links the image must keep."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        def add(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"",
                mode: int = 0o644, uid: int = 0, linkname: str = "") -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.uid, info.gid = kind, mode, uid, uid
            info.linkname, info.size = linkname, len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)

        add("./", tarfile.DIRTYPE, mode=0o755)
        for d in ("./etc", "./usr", "./usr/bin", "./home", "./home/u"):
            add(d, tarfile.DIRTYPE, mode=0o755)
        add("./tmp", tarfile.DIRTYPE, mode=0o1777)
        add("./etc/os-release", data=b"PRETTY_NAME=tiny\n")
        add("./usr/bin/su-ish", data=b"#!/bin/sh\n", mode=0o4755)
        add("./home/u/notes", data=b"mine\n", mode=0o600, uid=1000)
        add("./etc/localtime", tarfile.SYMTYPE, linkname="/usr/share/zoneinfo/UTC")
        add("./etc/os-release.hard", tarfile.LNKTYPE, linkname="./etc/os-release")
    raw = buf.getvalue()
    return zstandard.ZstdCompressor().compress(raw) if compress else raw


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "zstd"])
def test_import_makes_a_real_ext4_image(ctrl, operator, platform, tmp_path, compress):
    name = "tiny-zst" if compress else "tiny"
    tarball = tmp_path / ("rootfs.tar.zst" if compress else "rootfs.tar")
    tarball.write_bytes(rootfs_tar(compress))
    cache = tmp_path / "cache"
    result = kibo(operator, "template", "import", name, "--rootfs", str(tarball),
                  "--platform", str(platform), "--cache-dir", str(cache))
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith(f"template {name}: created, revision 1")
    assert "uploading" in result.stderr

    tpl = kibo_json(operator, "template", "get", name)
    assert tpl["source"]["kind"] == "import"
    assert tpl["source"]["tarball"]["compression"] == ("zstd" if compress else "auto")
    image = artifact(ctrl, tpl["image"]["digest"])
    assert image.stat().st_size == tpl["image"]["size"]
    assert debugfs(image, "cat /etc/os-release") == "PRETTY_NAME=tiny\n"
    assert debugfs(image, "cat /etc/os-release.hard") == "PRETTY_NAME=tiny\n"
    agent = debugfs(image, f"cat {bt.AGENT_GUEST_PATH}")
    assert agent == bt.repo_agent().read_text()
    assert "Mode:  0755" in debugfs(image, f"stat {bt.AGENT_GUEST_PATH}")
    assert "Mode:  04755" in debugfs(image, "stat /usr/bin/su-ish")
    assert "Mode:  01777" in debugfs(image, "stat /tmp")
    notes = debugfs(image, "stat /home/u/notes")
    assert "User:  1000" in notes
    assert "Mode:  0600" in notes
    assert "/usr/share/zoneinfo/UTC" in debugfs(image, "stat /etc/localtime")
    assert artifact(ctrl, tpl["kernel_digest"]).read_bytes() == (
        platform / "vmlinux").read_bytes()

    # Again: the image comes from the cache, nothing is uploaded, nothing changes.
    again = kibo(operator, "template", "import", name, "--rootfs", str(tarball),
                 "--platform", str(platform), "--cache-dir", str(cache))
    assert again.exit_code == 0, again.stderr
    assert again.stdout.startswith(f"template {name}: unchanged, revision 1")
    assert "uploading" not in again.stderr
    assert again.stderr.count("already in ctrl's store") == 3


def _evil_tar(members: list[tuple[str, bytes, str]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, kind, linkname in members:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, linkname
            tar.addfile(info, None)
    return buf.getvalue()


@pytest.mark.parametrize(("members", "message"), [
    ([("../escape", tarfile.REGTYPE, "")], "leaves the tree"),
    ([("etc", tarfile.SYMTYPE, "/tmp"), ("etc/passwd", tarfile.REGTYPE, "")],
     "goes through the symbolic link /etc"),
    ([("x", tarfile.LNKTYPE, "../../etc/shadow")], "leaves the tree"),
])
def test_hostile_tarballs_are_refused(ctrl, operator, platform, tmp_path, members, message):
    tarball = tmp_path / "evil.tar"
    tarball.write_bytes(_evil_tar(members))
    before = sorted(artifact(ctrl, "").parent.iterdir())
    result = kibo(operator, "template", "import", "evil", "--rootfs", str(tarball),
                  "--platform", str(platform), "--cache-dir", str(tmp_path / "cache"))
    assert result.exit_code == 10, result.stderr
    assert message in result.stderr
    assert sorted(artifact(ctrl, "").parent.iterdir()) == before
    assert not (tmp_path / "escape").exists()
    assert kibo(operator, "template", "get", "evil").exit_code == 12
    assert list((tmp_path / "cache" / "imports").glob("sha256-*")) == []


def test_not_a_tarball_is_refused(operator, platform, tmp_path):
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"\x28\xb5\x2f\xfd" + b"not zstd at all" * 10)
    result = kibo(operator, "template", "import", "junk", "--rootfs", str(junk),
                  "--platform", str(platform), "--cache-dir", str(tmp_path / "cache"))
    assert result.exit_code == 10, result.stderr
    assert "not a readable tar archive" in result.stderr


def test_build_from_a_recipe_is_cached(ctrl, operator, platform, tmp_path, monkeypatch):
    log = tmp_path / "debootstrap.log"
    fake = tmp_path / "debootstrap"
    fake.write_text(FAKE_DEBOOTSTRAP.format(log=log))
    fake.chmod(0o755)
    monkeypatch.setattr(bt, "DEBOOTSTRAP", str(fake))
    (tmp_path / "motd").write_text("welcome\n")
    recipe = tmp_path / "recipe.toml"
    recipe.write_text('suite = "bookworm"\npackages = ["python3", "curl"]\n'
                      'mirror = "http://mirror.example/debian"\n'
                      '[files."/etc/motd"]\nsource = "motd"\n'
                      '[files."/etc/greeting"]\ncontent = "hi\\n"\nmode = "0600"\n')
    args = ("template", "build", "built", "--recipe", str(recipe), "--platform",
            str(platform), "--cache-dir", str(tmp_path / "cache"))
    first = kibo(operator, *args)
    assert first.exit_code == 0, first.stderr
    assert first.stdout.startswith("template built: created, revision 1")
    assert log.read_text().split()[:3] == ["--variant=minbase", "--include=python3,curl",
                                           "bookworm"]
    tpl = kibo_json(operator, "template", "get", "built")
    assert tpl["source"]["recipe"]["packages"] == ["python3", "curl"]
    image = artifact(ctrl, tpl["image"]["digest"])
    assert debugfs(image, "cat /etc/motd") == "welcome\n"
    assert debugfs(image, "cat /etc/greeting") == "hi\n"
    assert "Mode:  0600" in debugfs(image, "stat /etc/greeting")
    assert debugfs(image, f"cat {bt.AGENT_GUEST_PATH}") == bt.repo_agent().read_text()

    second = kibo(operator, *args)
    assert second.exit_code == 0, second.stderr
    assert second.stdout.startswith("template built: unchanged, revision 1")
    assert len(log.read_text().splitlines()) == 1  # no second debootstrap
    assert "uploading" not in second.stderr

    # A changed file: a new image from the cached rootfs, revision 2.
    (tmp_path / "motd").write_text("welcome back\n")
    third = kibo(operator, *args, "--expected-version", "1")
    assert third.exit_code == 0, third.stderr
    assert third.stdout.startswith("template built: updated, revision 2")
    assert third.stderr.count("uploading") == 1
    assert "image sha256:" in third.stderr
    assert len(log.read_text().splitlines()) == 1


def test_the_kibotos_base_recipe_loads(tmp_path):
    from kibotos.cli.workspace.template_images import load_recipe

    path = Path(__file__).parents[2] / "packaging" / "template" / "kibotos-base.toml"
    recipe = load_recipe(path, "kibotos-base", tmp_path)
    assert (recipe.suite, recipe.variant, recipe.packages) == ("bookworm", "minbase",
                                                              ("python3",))
    assert recipe.files == bt.agent_files()  # the launcher and the kibotos_guest package
    assert recipe.files[bt.AGENT_GUEST_PATH] == (bt.repo_agent(), 0o755)


@pytest.mark.parametrize(("text", "message"), [
    ('suite = "bookworm"\ncolour = "red"\n', "unknown key colour"),
    ('packages = ["python3"]\n', "suite is required"),
    ('suite = "bookworm"\n[files."/x"]\nsource = "a"\ncontent = "b"\n', "exactly one of"),
    ('suite = "bookworm"\n[files."/x"]\ncontent = "b"\nmode = "99"\n', "not an octal"),
    ('suite = [', "not readable TOML"),
])
def test_bad_recipes_are_refused_before_anything_runs(operator, tmp_path, text, message):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(text)
    result = kibo(operator, "template", "build", "bad", "--recipe", str(recipe),
                  "--cache-dir", str(tmp_path / "cache"))
    assert result.exit_code == 10, result.stderr
    assert message in result.stderr
    assert not (tmp_path / "cache" / "rootfs").exists()


def test_list_get_delete(ctrl, operator, platform, tmp_path):
    tarball = tmp_path / "rootfs.tar"
    tarball.write_bytes(rootfs_tar())
    for name in ("del-a", "del-b"):
        assert kibo(operator, "template", "import", name, "--rootfs", str(tarball),
                    "--platform", str(platform), "--cache-dir",
                    str(tmp_path / "cache")).exit_code == 0
    listing = kibo(operator, "template", "list")
    assert listing.exit_code == 0
    rows = [line for line in listing.stdout.splitlines() if line.startswith("| del-")]
    assert [r.split("|")[1].strip() for r in rows] == ["del-a", "del-b"]
    assert "| NAME " in listing.stdout
    shown = kibo(operator, "template", "get", "del-a")
    assert "Template del-a" in shown.stdout
    assert "Kind:" in shown.stdout
    stale = kibo(operator, "template", "delete", "del-a", "--expected-version", "5")
    assert stale.exit_code == 14
    deleted = kibo(operator, "template", "delete", "del-a", "--command-id", "del-a-1")
    assert deleted.exit_code == 0, deleted.stderr
    assert deleted.stdout.strip() == "deleted template del-a (revision 1)"
    replay = kibo(operator, "template", "delete", "del-a", "--command-id", "del-a-1")
    assert replay.exit_code == 0
    assert kibo(operator, "template", "get", "del-a").exit_code == 12
    assert kibo(operator, "template", "delete", "del-a").exit_code == 12
    names = [t["name"] for t in kibo_json(operator, "template", "list")["templates"]]
    assert "del-b" in names
    assert "del-a" not in names


@pytest.mark.parametrize("args", [
    ("get", "Bad_Name"), ("delete", "x-"),
    ("import", "x..", "--rootfs", "/nonexistent.tar"),
    ("import", "ok", "--rootfs", "/nonexistent.tar"),
    ("build", "ok", "--recipe", "/nonexistent.toml"),
])
def test_bad_arguments_exit_10_and_send_nothing(tmp_path, args):
    # No kibo.toml at all: a check that passed would fail later with another message.
    result = invoke(tmp_path / "missing.toml", "template", *args)
    assert result.exit_code == 10, result.stderr
    assert "does not exist: run `kibo enroll`" not in result.stderr
