"""Just enough ELF reading to check a guest kernel and list a kernel module's facts.

Two questions are asked of ELF files here, and neither needs a general ELF library:
does this vmlinux carry the PVH entry note that ``-M microvm`` boots through, and what
does this ``.ko`` declare in its ``.modinfo`` section (its name and ``depends=``).  The
machine building the Platform has no kmod (no ``depmod``, no ``modinfo``), and the
Debian package ships no ``modules.dep`` (depmod writes it at install time), so we read
the same facts depmod would.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kibotos.core.errors import InvalidArgument

ELF_MAGIC = b"\x7fELF"
PT_NOTE = 4
#: Xen's ELF note for the 32-bit physical entry point; QEMU and Firecracker use it for PVH.
XEN_ELFNOTE_PHYS32_ENTRY = 18


@dataclass(frozen=True)
class _Header:
    phoff: int
    shoff: int
    phentsize: int
    phnum: int
    shentsize: int
    shnum: int
    shstrndx: int


def _header(data: bytes, what: str) -> _Header:
    if data[:4] != ELF_MAGIC:
        raise InvalidArgument(f"{what} is not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise InvalidArgument(f"{what} is not a 64-bit little-endian ELF file")
    (phoff, shoff) = struct.unpack_from("<QQ", data, 0x20)
    (phentsize, phnum, shentsize, shnum, shstrndx) = struct.unpack_from("<HHHHH", data, 0x36)
    return _Header(phoff, shoff, phentsize, phnum, shentsize, shnum, shstrndx)


def _notes(blob: bytes) -> list[tuple[bytes, int, bytes]]:
    """(name, type, desc) of each note in a note segment; 4-byte alignment."""
    out: list[tuple[bytes, int, bytes]] = []
    pos = 0
    while pos + 12 <= len(blob):
        namesz, descsz, ntype = struct.unpack_from("<III", blob, pos)
        pos += 12
        name = blob[pos : pos + namesz].rstrip(b"\x00")
        pos += (namesz + 3) & ~3
        desc = blob[pos : pos + descsz]
        pos += (descsz + 3) & ~3
        out.append((name, ntype, desc))
    return out


def pvh_entry(data: bytes, what: str = "vmlinux") -> int | None:
    """The PVH entry address of a kernel ELF image, or None if it has no PVH note."""
    hdr = _header(data, what)
    for i in range(hdr.phnum):
        off = hdr.phoff + i * hdr.phentsize
        (ptype,) = struct.unpack_from("<I", data, off)
        if ptype != PT_NOTE:
            continue
        (p_offset,) = struct.unpack_from("<Q", data, off + 8)
        (p_filesz,) = struct.unpack_from("<Q", data, off + 32)
        for name, ntype, desc in _notes(data[p_offset : p_offset + p_filesz]):
            if name == b"Xen" and ntype == XEN_ELFNOTE_PHYS32_ENTRY and len(desc) >= 4:
                # The note holds a 32-bit address, padded to 8 bytes on some builds.
                return int(struct.unpack_from("<I", desc)[0])
    return None


def section(data: bytes, name: str, what: str) -> bytes | None:
    """The bytes of the named section, or None when the file has no such section."""
    hdr = _header(data, what)
    if hdr.shoff == 0 or hdr.shnum == 0:
        return None

    def sh(i: int) -> tuple[int, int, int]:
        base = hdr.shoff + i * hdr.shentsize
        (sh_name,) = struct.unpack_from("<I", data, base)
        (sh_offset, sh_size) = struct.unpack_from("<QQ", data, base + 24)
        return sh_name, sh_offset, sh_size

    _, str_off, str_size = sh(hdr.shstrndx)
    strtab = data[str_off : str_off + str_size]
    want = name.encode()
    for i in range(hdr.shnum):
        sh_name, off, size = sh(i)
        end = strtab.find(b"\x00", sh_name)
        if strtab[sh_name:end] == want:
            return data[off : off + size]
    return None


def modinfo(data: bytes, what: str) -> dict[str, list[str]]:
    """The ``key=value`` strings of a kernel module's ``.modinfo`` section, by key."""
    blob = section(data, ".modinfo", what)
    if blob is None:
        raise InvalidArgument(f"{what} has no .modinfo section: not a kernel module")
    info: dict[str, list[str]] = {}
    for raw in blob.split(b"\x00"):
        if b"=" not in raw:
            continue
        key, _, value = raw.decode("utf-8", "replace").partition("=")
        info.setdefault(key, []).append(value)
    return info
