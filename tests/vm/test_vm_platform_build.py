"""The Platform builder's parts on small real inputs: ELF notes, the bzImage payload,
module dependencies, the cpio writer, the initramfs, the cache, and a whole offline
build from local .debs."""

from __future__ import annotations

import gzip
import json
import shutil
import stat
import threading
from pathlib import Path

import pytest
import zstandard
from vm_fakes import (
    FAKE_BUSYBOX,
    build_deb,
    bzimage,
    kernel_module,
    make_elf,
    module_tree,
    pvh_kernel,
    read_cpio,
)

from kibotos.core.errors import FailedPrecondition, InvalidArgument
from kibotos.platform import build_platform as bp
from kibotos.platform.cache import cached_build, input_key
from kibotos.platform.cpio import CpioWriter
from kibotos.platform.elf import modinfo, pvh_entry
from kibotos.platform.initramfs import build_initramfs, init_script
from kibotos.platform.kernel import extract_vmlinux
from kibotos.platform.modules import ModuleTree, module_name, modules_dep_lines

needs_dpkg = pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")

# ----------------------------------------------------------------------------- kernel


def test_pvh_note_is_found_and_its_absence_reported():
    assert pvh_entry(pvh_kernel(0x1000850)) == 0x1000850
    assert pvh_entry(make_elf(notes=[(b"GNU", 3, b"x" * 20)])) is None
    with pytest.raises(InvalidArgument, match="not an ELF file"):
        pvh_entry(b"MZ" + b"\0" * 100)


def test_vmlinux_is_the_xz_payload_past_a_false_magic():
    kernel = pvh_kernel()
    assert extract_vmlinux(bzimage(kernel)) == kernel


def test_an_elf_kernel_passes_through_when_it_has_the_note():
    kernel = pvh_kernel()
    assert extract_vmlinux(kernel) == kernel
    with pytest.raises(InvalidArgument, match="without a PVH entry note"):
        extract_vmlinux(make_elf(sections={".text": b"\x90"}))


def test_payloads_without_a_pvh_kernel_are_refused_with_the_reason():
    with pytest.raises(InvalidArgument, match="no PVH entry note"):
        extract_vmlinux(bzimage(make_elf(sections={".text": b"\x90"})))
    with pytest.raises(InvalidArgument, match="no xz-compressed payload"):
        extract_vmlinux(bzimage(b"")[:0x400])
    with pytest.raises(InvalidArgument, match="neither an x86 bzImage nor an ELF"):
        extract_vmlinux(b"\0" * 4096)


# ----------------------------------------------------------------------------- modules


def test_modinfo_fields_are_read():
    info = modinfo(kernel_module("ext4", ["jbd2", "mbcache"]), "ext4.ko")
    assert info["name"] == ["ext4"]
    assert info["depends"] == ["jbd2,mbcache"]
    with pytest.raises(InvalidArgument, match=r"no \.modinfo section"):
        modinfo(make_elf(sections={".text": b"\x90"}), "x.ko")


def test_module_names_normalise_suffixes_and_dashes():
    assert module_name("kernel/fs/ext4/ext4.ko") == "ext4"
    assert module_name("crc32c-generic.ko.xz") == "crc32c_generic"
    assert module_name("a/b.ko.zst") == "b"


def test_dependencies_come_first_and_the_requested_order_is_kept(tmp_path: Path):
    moddir = module_tree(tmp_path, "6.1.0-t", {
        "virtio": ["virtio_ring"], "virtio_ring": [], "virtio_blk": ["virtio", "virtio_ring"],
        "ext4": ["jbd2", "crc16"], "jbd2": [], "crc16": [], "overlay": []}, xz=("jbd2",))
    tree = ModuleTree(moddir)
    order = tree.load_order(["virtio_ring", "virtio", "virtio_blk", "ext4", "overlay"])
    assert [m.name for m in order] == ["virtio_ring", "virtio", "virtio_blk", "jbd2",
                                       "crc16", "ext4", "overlay"]
    jbd2 = next(m for m in order if m.name == "jbd2")
    assert jbd2.relpath.endswith("jbd2.ko.xz")
    dep = modules_dep_lines(order).splitlines()
    assert "kernel/drivers/test/ext4.ko: kernel/drivers/test/jbd2.ko.xz " \
           "kernel/drivers/test/crc16.ko" in dep
    assert "kernel/drivers/test/overlay.ko:" in dep


def test_an_existing_modules_dep_is_preferred(tmp_path: Path):
    moddir = module_tree(tmp_path, "6.1.0-t", {"a": [], "b": [], "c": []})
    # modules.dep says a needs c, although a's .modinfo declares nothing.
    (moddir / "modules.dep").write_text(
        "kernel/drivers/test/a.ko: kernel/drivers/test/c.ko\n"
        "kernel/drivers/test/b.ko:\nkernel/drivers/test/c.ko:\n")
    assert [m.name for m in ModuleTree(moddir).load_order(["a", "b"])] == ["c", "a", "b"]


def test_missing_modules_and_cycles_are_named(tmp_path: Path):
    moddir = module_tree(tmp_path, "6.1.0-t", {"x": ["y"], "y": ["x"], "z": ["nope"]})
    tree = ModuleTree(moddir)
    with pytest.raises(InvalidArgument, match="cycle: x -> y"):
        tree.load_order(["x"])
    with pytest.raises(InvalidArgument, match="kernel module 'nope' not found"):
        tree.load_order(["z"])
    with pytest.raises(InvalidArgument, match="does not exist"):
        ModuleTree(tmp_path / "absent")


# ----------------------------------------------------------------------------- cpio


def test_cpio_archive_round_trips_and_is_reproducible():
    def archive() -> bytes:
        w = CpioWriter()
        w.directory("bin")
        w.file("bin/busybox", b"\x7fELF-ish", 0o755)
        w.symlink("bin/sh", "busybox")
        w.directory("dev")
        w.char_device("dev/console", 5, 1)
        w.file("init", b"#!/bin/sh\n", 0o755)
        return w.render()

    data = archive()
    assert data == archive()
    entries = read_cpio(data)
    assert list(entries) == ["bin", "bin/busybox", "bin/sh", "dev", "dev/console", "init"]
    mode, body, _ = entries["bin/busybox"]
    assert stat.S_ISREG(mode)
    assert stat.S_IMODE(mode) == 0o755
    assert body == b"\x7fELF-ish"
    mode, body, _ = entries["bin/sh"]
    assert stat.S_ISLNK(mode)
    assert body == b"busybox"
    mode, _, rdev = entries["dev/console"]
    assert stat.S_ISCHR(mode)
    assert rdev == (5, 1)
    assert len(data) % 4 == 0


def test_cpio_refuses_duplicates_and_orphans():
    w = CpioWriter()
    w.directory("etc")
    with pytest.raises(InvalidArgument, match="given twice"):
        w.directory("etc")
    with pytest.raises(InvalidArgument, match="before its directory"):
        w.file("lib/x", b"")


# ----------------------------------------------------------------------------- initramfs


def _initramfs_inputs(tmp_path: Path) -> tuple[Path, Path, list]:
    busybox = tmp_path / "busybox"
    busybox.write_bytes(FAKE_BUSYBOX)
    busybox.chmod(0o755)
    tini = tmp_path / "tini"
    tini.write_bytes(b"tini-static")
    moddir = module_tree(tmp_path, "6.1.0-t", {"virtio": [], "ext4": ["virtio"]})
    tree = ModuleTree(moddir)
    mods = [(m, (moddir / m.relpath).read_bytes()) for m in tree.load_order(["ext4"])]
    return busybox, tini, mods


@pytest.mark.parametrize("compression", ["gzip", "zstd", "none"])
def test_initramfs_layout(tmp_path: Path, compression: str):
    busybox, tini, mods = _initramfs_inputs(tmp_path)
    blob = build_initramfs(busybox=busybox, tini=tini, release="6.1.0-t", modules=mods,
                           compression=compression)
    raw = {"gzip": gzip.decompress,
           "zstd": lambda b: zstandard.ZstdDecompressor().decompressobj().decompress(b),
           "none": lambda b: b}[compression](blob)
    entries = read_cpio(raw)
    assert entries["init"][1] == init_script()
    assert stat.S_IMODE(entries["init"][0]) == 0o755
    assert entries["bin/busybox"][1] == FAKE_BUSYBOX
    assert entries["bin/sh"][1] == b"busybox"
    assert entries["bin/switch_root"][1] == b"busybox"
    assert entries["bin/tini"][1] == b"tini-static"
    assert entries["dev/console"][2] == (5, 1)
    assert entries["etc/kibotos/modules"][1] == (
        b"6.1.0-t/kernel/drivers/test/virtio.ko\n6.1.0-t/kernel/drivers/test/ext4.ko\n")
    assert "lib/modules/6.1.0-t/kernel/drivers/test/ext4.ko" in entries
    assert entries["etc/kibotos/modules.vsock"][1] == b""
    assert entries["lib/modules/6.1.0-t/modules.dep"][1].startswith(
        b"kernel/drivers/test/virtio.ko:")
    with pytest.raises(InvalidArgument, match="unknown initramfs compression"):
        build_initramfs(busybox=busybox, tini=tini, release="6.1.0-t", modules=mods,
                        compression="lz4")


def test_busybox_without_a_needed_applet_is_refused(tmp_path: Path):
    busybox, tini, mods = _initramfs_inputs(tmp_path)
    busybox.write_bytes(b"#!/bin/sh\necho sh mount\n")
    with pytest.raises(FailedPrecondition, match="lacks the 'insmod' applet"):
        build_initramfs(busybox=busybox, tini=tini, release="6.1.0-t", modules=mods,
                        compression="none")


# ----------------------------------------------------------------------------- cache


def test_cache_builds_once_and_keeps_nothing_of_a_failed_build(tmp_path: Path):
    calls = []

    def build(d: Path) -> None:
        calls.append(d)
        (d / "data").write_text("x")
        (d / "m.json").write_text("{}")

    key = input_key({"a": 1})
    first = cached_build(tmp_path, key, "m.json", build)
    assert first == tmp_path / f"sha256-{key}"
    assert (first / "data").read_text() == "x"
    assert cached_build(tmp_path, key, "m.json", build) == first
    assert len(calls) == 1

    def broken(d: Path) -> None:
        (d / "partial").write_text("half")
        raise FailedPrecondition("boom")

    other = input_key({"a": 2})
    with pytest.raises(FailedPrecondition, match="boom"):
        cached_build(tmp_path, other, "m.json", broken)
    with pytest.raises(FailedPrecondition, match=r"wrote no m\.json"):
        cached_build(tmp_path, other, "m.json", lambda d: None)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [
        f"sha256-{key}"]


def test_concurrent_builders_of_one_key_build_once(tmp_path: Path):
    calls = []
    gate = threading.Event()

    def build(d: Path) -> None:
        calls.append(1)
        gate.wait(5)
        (d / "m.json").write_text("{}")

    key = input_key("same")
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(
        cached_build(tmp_path, key, "m.json", build))) for _ in range(3)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join(30)
    assert len(calls) == 1
    assert len(set(results)) == 1
    assert len(results) == 3


def test_input_key_is_canonical():
    assert input_key({"b": [1, 2], "a": "x"}) == input_key({"a": "x", "b": [1, 2]})
    assert input_key({"a": 1}) != input_key({"a": 2})


# ----------------------------------------------------------------------------- whole build


@needs_dpkg
def test_offline_platform_build_from_local_debs(tmp_path: Path, monkeypatch):
    release = "6.1.0-99-amd64"
    kernel = pvh_kernel()
    mods = {"virtio_ring": [], "virtio": ["virtio_ring"], "virtio_mmio": ["virtio"],
            "virtio_console": ["virtio"], "virtio_blk": ["virtio"], "crc32c_generic": [],
            "jbd2": [], "ext4": ["jbd2"], "overlay": [], "vsock": [],
            "vmw_vsock_virtio_transport_common": ["vsock", "virtio"],
            "vmw_vsock_virtio_transport": ["vmw_vsock_virtio_transport_common"],
            "failover": [], "net_failover": ["failover"],
            "virtio_net": ["net_failover", "virtio"]}
    files: dict[str, tuple[bytes, int]] = {
        f"/boot/vmlinuz-{release}": (bzimage(kernel), 0o644)}
    for name, deps in mods.items():
        files[f"/lib/modules/{release}/kernel/x/{name}.ko"] = (kernel_module(name, deps),
                                                               0o644)
    kdeb = build_deb(tmp_path, f"linux-image-{release}", "6.1.999-1", files)
    bdeb = build_deb(tmp_path, "busybox-static", "1:1.35-1", {"/bin/busybox": (FAKE_BUSYBOX,
                                                                               0o755)})
    tdeb = build_deb(tmp_path, "tini", "0.19-1", {"/usr/bin/tini-static": (b"tini", 0o755)})
    cache = tmp_path / "cache"

    out = bp.build_platform(cache_root=cache, kernel_deb=kdeb, busybox_deb=bdeb,
                            tini_deb=tdeb)
    manifest = json.loads((out / "platform.json").read_text())
    assert manifest["kernel"]["release"] == release
    assert manifest["kernel"]["package"] == f"linux-image-{release}"
    assert manifest["modules"] == ["virtio_ring", "virtio", "virtio_mmio", "virtio_console",
                                   "virtio_blk", "crc32c_generic", "jbd2", "ext4", "overlay"]
    # The vsock modules are in the image but loaded only for kibotos.vsock=PORT.
    assert manifest["vsock_modules"] == ["vsock", "vmw_vsock_virtio_transport_common",
                                         "vmw_vsock_virtio_transport"]
    assert (out / "vmlinux").read_bytes() == kernel
    entries = read_cpio(gzip.decompress((out / "initramfs").read_bytes()))
    assert entries["bin/tini"][1] == b"tini"
    assert entries["etc/kibotos/modules.vsock"][1] == "".join(
        f"{release}/kernel/x/{m}.ko\n" for m in manifest["vsock_modules"]).encode()
    assert f"{release}/kernel/x/vsock.ko".encode() not in entries["etc/kibotos/modules"][1]
    assert f"lib/modules/{release}/kernel/x/vsock.ko" in entries
    # virtio-net and its dependencies likewise, only for kibotos.net=1.
    assert manifest["net_modules"] == ["failover", "net_failover", "virtio_net"]
    assert entries["etc/kibotos/modules.net"][1] == "".join(
        f"{release}/kernel/x/{m}.ko\n" for m in manifest["net_modules"]).encode()
    assert b"virtio_net" not in entries["etc/kibotos/modules"][1]
    import hashlib
    assert manifest["files"]["initramfs"]["sha256"] == hashlib.sha256(
        (out / "initramfs").read_bytes()).hexdigest()

    # Same inputs: the same directory, without building again.
    def no_build(*args, **kwargs):
        raise AssertionError("rebuilt although nothing changed")

    monkeypatch.setattr(bp, "_build", no_build)
    assert bp.build_platform(cache_root=cache, kernel_deb=kdeb, busybox_deb=bdeb,
                             tini_deb=tdeb) == out
    monkeypatch.undo()
    # Another compression is another input: another directory.
    other = bp.build_platform(cache_root=cache, kernel_deb=kdeb, busybox_deb=bdeb,
                              tini_deb=tdeb, compression="none")
    assert other != out
    read_cpio((other / "initramfs").read_bytes())


@needs_dpkg
def test_a_kernel_package_without_a_needed_module_names_it(tmp_path: Path):
    release = "6.1.0-98-amd64"
    kdeb = build_deb(tmp_path, f"linux-image-{release}", "1", {
        f"/boot/vmlinuz-{release}": (bzimage(pvh_kernel()), 0o644),
        f"/lib/modules/{release}/kernel/x/virtio.ko": (kernel_module("virtio", []), 0o644)})
    bdeb = build_deb(tmp_path, "busybox-static", "1", {"/bin/busybox": (FAKE_BUSYBOX, 0o755)})
    tdeb = build_deb(tmp_path, "tini", "1", {"/usr/bin/tini-static": (b"t", 0o755)})
    with pytest.raises(InvalidArgument, match="kernel module 'virtio_ring' not found"):
        bp.build_platform(cache_root=tmp_path / "c", kernel_deb=kdeb, busybox_deb=bdeb,
                          tini_deb=tdeb)
    assert not list((tmp_path / "c" / "platforms").glob("sha256-*"))
