"""Small, real inputs for the Platform builder: ELF files, a bzImage, kernel modules,
Debian packages and a newc cpio reader.

They are made byte by byte (no kernel download), so the builder's logic is tested in
milliseconds; the VM tests then run the same code on Debian's real kernel.
"""

from __future__ import annotations

import lzma
import struct
import subprocess
from pathlib import Path

PT_NOTE = 4


def _note(name: bytes, ntype: int, desc: bytes) -> bytes:
    name0 = name + b"\0"
    out = struct.pack("<III", len(name0), len(desc), ntype)
    out += name0 + b"\0" * (-len(name0) % 4)
    out += desc + b"\0" * (-len(desc) % 4)
    return out


def make_elf(*, notes: list[tuple[bytes, int, bytes]] | None = None,
             sections: dict[str, bytes] | None = None) -> bytes:
    """A 64-bit little-endian ELF file with one PT_NOTE segment (if `notes`) and the
    given sections (plus the null section and .shstrtab)."""
    notes = notes or []
    sections = sections or {}
    note_blob = b"".join(_note(*n) for n in notes)
    phnum = 1 if notes else 0
    off = 64 + 56 * phnum
    note_off = off
    off += len(note_blob)
    names = ["", *list(sections), ".shstrtab"]
    shstrtab = b""
    name_off = {}
    for n in names:
        name_off[n] = len(shstrtab)
        shstrtab += n.encode() + b"\0"
    body = b""
    sec_offsets = {}
    for name, data in sections.items():
        sec_offsets[name] = off + len(body)
        body += data
    sec_offsets[".shstrtab"] = off + len(body)
    body += shstrtab
    shoff = off + len(body)
    shnum = len(names)
    header = b"\x7fELF" + bytes([2, 1, 1, 0]) + b"\0" * 8
    header += struct.pack("<HHIQQQIHHHHHH", 2, 0x3E, 1, 0, 64 if phnum else 0, shoff, 0,
                          64, 56, phnum, 64, shnum, shnum - 1)
    phdrs = b""
    if phnum:
        phdrs = struct.pack("<IIQQQQQQ", PT_NOTE, 4, note_off, 0, 0, len(note_blob),
                            len(note_blob), 4)
    shdrs = b"\0" * 64
    for name in names[1:]:
        data = shstrtab if name == ".shstrtab" else sections[name]
        shdrs += struct.pack("<IIQQQQIIQQ", name_off[name], 3 if name == ".shstrtab" else 1,
                             0, 0, sec_offsets[name], len(data), 0, 0, 1, 0)
    return header + phdrs + note_blob + body + shdrs


def pvh_kernel(entry: int = 0x1000850) -> bytes:
    """An ELF 'kernel' carrying the Xen PVH entry note (type 18)."""
    return make_elf(notes=[(b"GNU", 3, b"\x01" * 20),
                           (b"Xen", 18, struct.pack("<Q", entry))])


def bzimage(payload: bytes, *, decoy: bool = True) -> bytes:
    """An x86 boot image: setup header magic at 0x202, a false xz magic (the real one
    can occur by chance), then `payload` as an xz stream and trailing bytes."""
    head = bytearray(0x400)
    head[0x202:0x206] = b"HdrS"
    if decoy:
        head[0x300:0x306] = b"\xfd7zXZ\x00"
    return bytes(head) + lzma.compress(payload, format=lzma.FORMAT_XZ) + b"\xaa" * 100


def kernel_module(name: str, depends: list[str]) -> bytes:
    info = f"name={name}\0depends={','.join(depends)}\0license=GPL\0".encode()
    return make_elf(sections={".modinfo": info, ".text": b"\x90" * 16})


def module_tree(root: Path, release: str, modules: dict[str, list[str]], *,
                subdir: str = "kernel/drivers/test", xz: tuple[str, ...] = ()) -> Path:
    """``<root>/lib/modules/<release>/<subdir>/<name>.ko[.xz]`` for each module."""
    moddir = root / "lib" / "modules" / release
    (moddir / subdir).mkdir(parents=True, exist_ok=True)
    for name, deps in modules.items():
        data = kernel_module(name, deps)
        if name in xz:
            (moddir / subdir / f"{name}.ko.xz").write_bytes(
                lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC32))
        else:
            (moddir / subdir / f"{name}.ko").write_bytes(data)
    return moddir


def build_deb(tmp: Path, package: str, version: str, files: dict[str, tuple[bytes, int]]
              ) -> Path:
    """A real .deb made with dpkg-deb --build from `files` (path -> (content, mode))."""
    root = tmp / f"debroot-{package}"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(
        f"Package: {package}\nVersion: {version}\nArchitecture: amd64\n"
        "Maintainer: test <test@example.invalid>\nDescription: test package\n")
    for path, (data, mode) in files.items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        target.chmod(mode)
    out = tmp / f"{package}_{version}_amd64.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root),
                    str(out)], check=True, capture_output=True)
    return out


#: A stand-in for busybox-static: answers ``--list`` like the real one.
FAKE_BUSYBOX = b"""#!/bin/sh
if [ "$1" = "--list" ]; then
    printf '%s\\n' busybox sh mount insmod switch_root poweroff usleep cp cat mkdir ln ip
    exit 0
fi
exit 1
"""


def read_cpio(data: bytes) -> dict[str, tuple[int, bytes, tuple[int, int]]]:
    """name -> (mode, data, (rdevmajor, rdevminor)) of a newc archive, in order."""
    out: dict[str, tuple[int, bytes, tuple[int, int]]] = {}
    pos = 0
    while True:
        assert data[pos:pos + 6] == b"070701", f"bad magic at {pos}"
        fields = [int(data[pos + 6 + 8 * i: pos + 14 + 8 * i], 16) for i in range(13)]
        mode, filesize, rmaj, rmin, namesize = (fields[1], fields[6], fields[9], fields[10],
                                                fields[11])
        name = data[pos + 110: pos + 110 + namesize - 1].decode()
        pos += 110 + namesize
        pos += -pos % 4
        body = data[pos: pos + filesize]
        pos += filesize
        pos += -pos % 4
        if name == "TRAILER!!!":
            return out
        out[name] = (mode, body, (rmaj, rmin))
