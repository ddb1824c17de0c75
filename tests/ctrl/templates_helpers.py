"""Small blobs that pass ctrl's format checks (an ext4 superblock magic, an ELF magic),
and uploading them."""

from __future__ import annotations

import hashlib
import os

import httpx
from ctrl_helpers import result


def image_blob(tag: bytes = b"") -> bytes:
    data = bytearray(os.urandom(4096))
    data[1080:1082] = b"\x53\xef"
    return bytes(data) + tag


def kernel_blob(tag: bytes = b"") -> bytes:
    return b"\x7fELF" + os.urandom(512) + tag


def initramfs_blob(tag: bytes = b"") -> bytes:
    return b"\x1f\x8b" + os.urandom(512) + tag


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def blob_path(data: bytes) -> str:
    return f"/v1/artifacts/sha256/{hashlib.sha256(data).hexdigest()}"


async def upload(client: httpx.AsyncClient, headers: dict[str, str], data: bytes
                 ) -> dict[str, object]:
    return dict(result(await client.put(blob_path(data), content=data, headers=headers)))


async def upload_set(client: httpx.AsyncClient, headers: dict[str, str]
                     ) -> dict[str, str]:
    """Upload an image, a kernel and an initramfs; the PUT body of a Template."""
    blobs = {"image_digest": image_blob(), "kernel_digest": kernel_blob(),
             "initramfs_digest": initramfs_blob()}
    for data in blobs.values():
        await upload(client, headers, data)
    return {k: digest(v) for k, v in blobs.items()}
