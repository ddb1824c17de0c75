"""Turn Debian's compressed kernel (bzImage) into the ELF vmlinux microvm boots by PVH.

TESTBED: the bzImage itself does not PVH-boot, but its payload is an xz stream
(magic ``FD 37 7A 58 5A 00``) that decompresses to an ELF vmlinux carrying the Xen PVH
entry note.  The magic can also occur by chance in the setup code, so each occurrence
is tried until one decompresses to an ELF file with the note.
"""

from __future__ import annotations

import lzma

from kibotos.core.errors import InvalidArgument
from kibotos.platform.elf import ELF_MAGIC, pvh_entry

XZ_MAGIC = b"\xfd7zXZ\x00"


def _xz_stream_at(data: bytes, offset: int) -> bytes | None:
    """Decompress the xz stream starting at `offset`; None if it is not a valid one.

    The decompressor stops at the end of the stream, so the bytes the bzImage carries
    after the payload (relocation data, padding) are ignored."""
    decomp = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
    try:
        out = decomp.decompress(data[offset:])
    except lzma.LZMAError:
        return None
    return out if decomp.eof else None


def extract_vmlinux(bzimage: bytes, what: str = "bzImage") -> bytes:
    """The PVH-bootable ELF kernel inside `bzimage`.

    Raises InvalidArgument naming what was found instead when no xz payload, or no
    payload with a PVH note, is present (e.g. a kernel compressed with zstd)."""
    if bzimage[:4] == ELF_MAGIC:
        if pvh_entry(bzimage, what) is None:
            raise InvalidArgument(f"{what} is an ELF kernel without a PVH entry note")
        return bzimage
    if bzimage[0x202:0x206] != b"HdrS":
        raise InvalidArgument(f"{what} is neither an x86 bzImage nor an ELF kernel")
    found_elf_without_note = False
    start = 0
    while (pos := bzimage.find(XZ_MAGIC, start)) >= 0:
        start = pos + 1
        payload = _xz_stream_at(bzimage, pos)
        if payload is None or payload[:4] != ELF_MAGIC:
            continue
        if pvh_entry(payload, f"{what} payload") is not None:
            return payload
        found_elf_without_note = True
    if found_elf_without_note:
        raise InvalidArgument(f"{what}: the decompressed kernel has no PVH entry note")
    raise InvalidArgument(f"{what}: no xz-compressed payload found (bytes FD 37 7A 58 5A 00)")
