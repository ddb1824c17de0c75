"""Secrets at rest in ctrl's store (an Egress's password), sealed with a key that is
not in the store.

A store backup or a read-only SQL account must not hand out the callers' SOCKS5
passwords, so the store keeps only AES-256-GCM ciphertext; the key is a file in ctrl's
state directory, ``egress-secrets.key`` (32 random bytes, mode 0600, made at the first
start like ``session-signing.key``).  Each ciphertext is bound to what it belongs to
(the `context`, e.g. the Egress name and revision) as associated data, so a row copied
onto another Egress or revision does not open.  Several ctrl replicas sharing one
PostgreSQL store need the same key file.

`mac` gives a keyed digest of a secret for the command journal, which compares the
input of a replay with the first one's: the journal keeps a digest of the input, and an
unkeyed hash of a short password would let anyone with the store guess it offline.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kibotos.core import key_files
from kibotos.core.errors import FailedPrecondition, Internal

KEY_FILE = "egress-secrets.key"
KEY_SIZE = 32
NONCE_SIZE = 12
#: The format of a sealed value: ``v1.<urlsafe base64 of nonce + ciphertext + tag>``.
PREFIX = "v1."


def key_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / KEY_FILE


class SecretBox:
    """Seals and opens secrets with one key (see the module docstring)."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_SIZE:
            raise ValueError(f"the key must be {KEY_SIZE} bytes")
        self._aead = AESGCM(key)
        # A key of its own for digests, so no value is ever both encrypted and MACed
        # under the same key.
        self._mac_key = hmac.new(key, b"kibotos secret-box mac", hashlib.sha256).digest()

    @classmethod
    def load_or_create(cls, path: Path) -> SecretBox:
        """The key in `path`, created there (0600) on first use.  An existing file of
        the wrong size or readable by others is an error naming it, never replaced:
        every sealed secret in the store depends on it."""
        data = key_files.read_or_create_private(path, "egress secrets key",
                                                lambda: secrets.token_bytes(KEY_SIZE))
        if len(data) != KEY_SIZE:
            raise FailedPrecondition(f"egress secrets key {path} has {len(data)} bytes, not "
                                     f"{KEY_SIZE}: restore the original file")
        return cls(data)

    def seal(self, secret: str, context: str) -> str:
        nonce = secrets.token_bytes(NONCE_SIZE)
        sealed = self._aead.encrypt(nonce, secret.encode(), context.encode())
        return PREFIX + base64.urlsafe_b64encode(nonce + sealed).decode()

    def open(self, sealed: str, context: str) -> str:
        """The secret; `Internal` (naming the context, never the value) when it was not
        sealed by this key for this context."""
        try:
            if not sealed.startswith(PREFIX):
                raise ValueError("unknown format")
            raw = base64.urlsafe_b64decode(sealed[len(PREFIX):])
            plain = self._aead.decrypt(raw[:NONCE_SIZE], raw[NONCE_SIZE:],
                                       context.encode())
            return plain.decode()
        except (ValueError, InvalidTag):
            raise Internal(f"the sealed secret of {context} does not open with this ctrl's "
                           f"{KEY_FILE} (was the file replaced?)") from None

    def mac(self, secret: str, context: str) -> str:
        """A keyed digest of `secret` for `context` (hex)."""
        message = context.encode() + b"\0" + secret.encode()
        return hmac.new(self._mac_key, message, hashlib.sha256).hexdigest()
