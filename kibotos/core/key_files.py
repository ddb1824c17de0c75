"""Reading the files that hold ctrl's keys and certificates (the session signing key,
the egress secrets key, the cluster CA), said the same way for each.

Each of these files is made once and never replaced: every credential, sealed secret
or issued certificate depends on it.  So a file that is there but unreadable, readable
by others or not a key is an error naming the file (`FailedPrecondition`), for the
operator to restore, never a reason to make a new one; only a missing file is made,
on first use, readable by its owner only in a directory only its owner can enter.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes

from kibotos.core import atomicfile
from kibotos.core.errors import FailedPrecondition


def read_if_present(path: Path, what: str) -> bytes | None:
    """The bytes of the file `what` names (``cluster CA certificate``), None if there
    is none; any other failure to read it is `FailedPrecondition`."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise FailedPrecondition(f"cannot read {what} {path}: {exc.strerror}") from None


def read_private_if_present(path: Path, what: str) -> bytes | None:
    """`read_if_present` of a secret: a file others may read is refused (a key that
    leaked may not be used as if it had not)."""
    data = read_if_present(path, what)
    if data is not None:
        mode = os.stat(path).st_mode & 0o777
        if mode & 0o077:
            raise FailedPrecondition(f"{what} {path} has mode {mode:04o}: it must be "
                                     "readable by its owner only (chmod 600)")
    return data


def read_or_create_private(path: Path, what: str, make: Callable[[], bytes]) -> bytes:
    """The secret in `path`; on first use the bytes `make` gives, written there (mode
    0600, the directory 0700) before they are returned."""
    data = read_private_if_present(path, what)
    if data is None:
        data = make()
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomicfile.write_bytes(path, data, mode=0o600)
    return data


def load_private_key(data: bytes, path: Path, what: str) -> PrivateKeyTypes:
    """The unencrypted PEM private key `data` read from `path`; anything else is
    `FailedPrecondition` naming the file (the caller checks the key's type)."""
    try:
        return serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise FailedPrecondition(f"{what} {path} is not a PEM private key: {exc}") from None
