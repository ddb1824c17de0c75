"""Session credentials: short-lived, signed by ctrl, verified by a node's data plane.

ctrl holds one Ed25519 key (`SigningKey`, ``<state_dir>/session-signing.key``) and sends
its public key to every node in ``welcome.session_signing_public_key``; the node hands it
to its data-plane process.  A caller asks ctrl for a credential for one Workspace
(``POST /v1/workspaces/{id}/sessions``) and presents it to the data plane, which checks
it with the public key alone: the data plane never asks ctrl, so it keeps working while
ctrl or the node is down (spec: node-and-vmm-processes, "Data-plane processes").

A credential is ``base64url(payload) "." base64url(signature)`` (no padding), the
signature taken over the ASCII of the first part, so no canonical JSON is needed.  The
payload is ``{workspace_id, instance_id, node_id, operations, iat, exp, jti}`` with
``iat``/``exp`` in Unix seconds.  Verification checks, in this order: the shape, the
signature, the times (with `LEEWAY` for clock skew between ctrl and the node), the node
and the operation.  A bad shape, signature or time is `Unauthenticated`; a good
credential used on the wrong node or for an operation it does not grant is
`PermissionDenied`.  Nothing is ever looked up, and nothing is stored: the ``jti`` is
there for logs.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kibotos.core import ids, key_files
from kibotos.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
)

#: What a session credential may grant: ``exec`` (and terminals), ``files`` (file
#: transfer and the file operations), ``ports`` (TCP connections to ports on the
#: guest's loopback: port forwarding).
OPERATIONS = ("exec", "files", "ports")
#: How long a credential is valid (docs/architecture.md: five minutes).
LIFETIME = 300
#: Clock skew tolerated between ctrl (which signs) and the node (which verifies): the
#: same bound placement puts on a node's clock.
LEEWAY = 30
#: The file name of ctrl's key inside its state directory.
KEY_FILE = "session-signing.key"

_MAX_CREDENTIAL = 4096


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64url(text: str, what: str) -> bytes:
    if not text or any(c not in _URLSAFE for c in text):
        raise Unauthenticated(f"malformed session credential: {what} is not base64url")
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise Unauthenticated(f"malformed session credential: {what} is not base64url") from None


_URLSAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


@dataclass(frozen=True)
class SessionClaims:
    """What a credential says; `iat` and `exp` are Unix seconds."""

    workspace_id: str
    instance_id: str
    node_id: str
    operations: tuple[str, ...]
    iat: int
    exp: int
    jti: str

    def to_json(self) -> dict[str, Any]:
        return {"workspace_id": self.workspace_id, "instance_id": self.instance_id,
                "node_id": self.node_id, "operations": list(self.operations),
                "iat": self.iat, "exp": self.exp, "jti": self.jti}

    @classmethod
    def from_json(cls, data: Any) -> SessionClaims:
        """Parse a payload; anything missing or of the wrong type is `Unauthenticated`
        (a payload is only ever parsed after its signature held, so this means a ctrl
        of another version, not an attacker)."""
        if not isinstance(data, dict):
            raise Unauthenticated("malformed session credential: payload is not an object")

        def text(key: str) -> str:
            value = data.get(key)
            if not isinstance(value, str) or not value:
                raise Unauthenticated(f"malformed session credential: {key} is missing")
            return value

        def integer(key: str) -> int:
            value = data.get(key)
            if not isinstance(value, int) or isinstance(value, bool):
                raise Unauthenticated(f"malformed session credential: {key} is missing")
            return value

        ops = data.get("operations")
        if not isinstance(ops, list) or not all(isinstance(o, str) for o in ops):
            raise Unauthenticated("malformed session credential: operations is missing")
        return cls(text("workspace_id"), text("instance_id"), text("node_id"), tuple(ops),
                   integer("iat"), integer("exp"), text("jti"))


def public_key_text(key: Ed25519PublicKey) -> str:
    """Standard base64 of the raw 32 bytes: the form identity keys use too."""
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode("ascii")


def parse_public_key(text: object) -> Ed25519PublicKey:
    """The verification key as `public_key_text` writes it; `InvalidArgument` otherwise."""
    if not isinstance(text, str):
        raise InvalidArgument("session signing public key must be a base64 string")
    try:
        raw = base64.b64decode(text, validate=True)
        return Ed25519PublicKey.from_public_bytes(raw)
    except (binascii.Error, ValueError) as exc:
        raise InvalidArgument(f"session signing public key {text[:60]!r} is not base64 of "
                              f"32 raw Ed25519 bytes: {exc}") from None


class SigningKey:
    """ctrl's private key; issues credentials."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.public_key = public_key_text(private_key.public_key())

    @classmethod
    def generate(cls) -> SigningKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: Path) -> SigningKey:
        """The key in `path` (PKCS#8 PEM, mode 0600), created there on first use.

        An existing file that is not an Ed25519 key is an error naming the file, never
        replaced: every credential and every node's copy of the public key depends on it.
        """
        what = "session signing key"

        def new_key() -> bytes:
            return Ed25519PrivateKey.generate().private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption())

        data = key_files.read_or_create_private(path, what, new_key)
        loaded = key_files.load_private_key(data, path, what)
        if not isinstance(loaded, Ed25519PrivateKey):
            raise FailedPrecondition(f"{what} {path} is not an Ed25519 key")
        return cls(loaded)

    def sign(self, claims: SessionClaims) -> str:
        payload = json.dumps(claims.to_json(), separators=(",", ":"), sort_keys=True)
        head = _b64url(payload.encode())
        return f"{head}.{_b64url(self._key.sign(head.encode('ascii')))}"

    def issue(self, *, workspace_id: str, instance_id: str, node_id: str,
              operations: tuple[str, ...] | list[str], now: float | None = None,
              lifetime: int = LIFETIME) -> tuple[str, SessionClaims]:
        """A fresh credential and its claims; `now` defaults to the wall clock."""
        unknown = [op for op in operations if op not in OPERATIONS]
        if not operations or unknown:
            raise InvalidArgument(f"operations must be a non-empty subset of "
                                  f"{list(OPERATIONS)}, got {list(operations)}")
        iat = int(time.time() if now is None else now)
        claims = SessionClaims(workspace_id, instance_id, node_id,
                               tuple(dict.fromkeys(operations)), iat, iat + lifetime,
                               ids.new_id("cred"))
        return self.sign(claims), claims


class Verifier:
    """Checks credentials with ctrl's public key; used by the data plane."""

    def __init__(self, public_key: object, *, leeway: float = LEEWAY) -> None:
        self._key = parse_public_key(public_key)
        self.public_key = public_key_text(self._key)
        self.leeway = leeway

    def verify(self, credential: str, *, node_id: str, operation: str,
               now: float | None = None) -> SessionClaims:
        """The claims of a credential valid for `operation` on `node_id` at `now`."""
        if not isinstance(credential, str) or len(credential) > _MAX_CREDENTIAL:
            raise Unauthenticated("malformed session credential")
        head, sep, tail = credential.strip().partition(".")
        if not sep or "." in tail:
            raise Unauthenticated("malformed session credential: expected "
                                  "<payload>.<signature>")
        signature = _unb64url(tail, "signature")
        payload = _unb64url(head, "payload")
        try:
            self._key.verify(signature, head.encode("ascii"))
        except InvalidSignature:
            raise Unauthenticated("session credential signature does not verify (tampered, "
                                  "or signed by another ctrl key)") from None
        try:
            claims = SessionClaims.from_json(json.loads(payload))
        except ValueError:
            raise Unauthenticated("malformed session credential: payload is not JSON") from None
        at = time.time() if now is None else now
        if at > claims.exp + self.leeway:
            raise Unauthenticated(f"session credential {claims.jti} expired "
                                  f"{at - claims.exp:.0f}s ago: ask ctrl for a new one")
        if at < claims.iat - self.leeway:
            raise Unauthenticated(f"session credential {claims.jti} is issued "
                                  f"{claims.iat - at:.0f}s in the future (clock skew between "
                                  "ctrl and this node?)")
        if claims.node_id != node_id:
            raise PermissionDenied(f"session credential {claims.jti} is for node "
                                   f"{claims.node_id}, not {node_id}")
        if operation not in claims.operations:
            raise PermissionDenied(f"session credential {claims.jti} does not grant "
                                   f"{operation!r} (it grants {', '.join(claims.operations)})")
        return claims


def key_path(state_dir: Path | str) -> Path:
    """Where ctrl keeps its session signing key."""
    return Path(state_dir) / KEY_FILE
