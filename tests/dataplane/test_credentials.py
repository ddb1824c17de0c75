"""Session credentials: issue, verify, and every way a credential is refused."""

from __future__ import annotations

import base64
import json
import os
import stat
from pathlib import Path

import pytest

from kibotos.core.credentials import (
    LEEWAY,
    LIFETIME,
    SessionClaims,
    SigningKey,
    Verifier,
    key_path,
    parse_public_key,
)
from kibotos.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
)

NOW = 1_767_225_600.0


def issue(key: SigningKey, **kw: object) -> str:
    args: dict[str, object] = {"workspace_id": "ws-1", "instance_id": "inst-1",
                               "node_id": "node-a", "operations": ["exec"], "now": NOW}
    args.update(kw)
    return key.issue(**args)[0]  # type: ignore[arg-type]


def b64url_json(part: str) -> dict[str, object]:
    return json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))


def test_round_trip_and_shape() -> None:
    key = SigningKey.generate()
    credential, claims = key.issue(workspace_id="ws-1", instance_id="inst-1",
                                   node_id="node-a", operations=["exec"], now=NOW)
    head, tail = credential.split(".")
    assert "=" not in credential
    payload = b64url_json(head)
    assert set(payload) == {"workspace_id", "instance_id", "node_id", "operations", "iat",
                            "exp", "jti"}
    assert payload["exp"] == payload["iat"] + LIFETIME == int(NOW) + 300
    assert len(base64.urlsafe_b64decode(tail + "==")) == 64
    got = Verifier(key.public_key).verify(credential, node_id="node-a", operation="exec",
                                          now=NOW + 10)
    assert got == claims
    assert got.operations == ("exec",)
    assert SessionClaims.from_json(payload) == claims


def test_each_credential_is_distinct() -> None:
    key = SigningKey.generate()
    first, second = issue(key), issue(key)
    assert first != second
    assert b64url_json(first.split(".")[0])["jti"] != b64url_json(second.split(".")[0])["jti"]


def test_expired_is_refused_after_the_leeway_only() -> None:
    key = SigningKey.generate()
    verifier = Verifier(key.public_key)
    credential = issue(key)
    verifier.verify(credential, node_id="node-a", operation="exec",
                    now=NOW + LIFETIME + LEEWAY - 1)
    with pytest.raises(Unauthenticated, match="expired"):
        verifier.verify(credential, node_id="node-a", operation="exec",
                        now=NOW + LIFETIME + LEEWAY + 1)


def test_issued_in_the_future_is_refused() -> None:
    key = SigningKey.generate()
    with pytest.raises(Unauthenticated, match="in the future"):
        Verifier(key.public_key).verify(issue(key), node_id="node-a", operation="exec",
                                        now=NOW - LEEWAY - 5)


def test_wrong_node_and_wrong_operation_are_permission_denied() -> None:
    key = SigningKey.generate()
    verifier = Verifier(key.public_key)
    with pytest.raises(PermissionDenied, match="is for node node-a, not node-b"):
        verifier.verify(issue(key), node_id="node-b", operation="exec", now=NOW)
    with pytest.raises(PermissionDenied, match="does not grant 'files'"):
        verifier.verify(issue(key), node_id="node-a", operation="files", now=NOW)


def test_tampered_payload_is_refused() -> None:
    key = SigningKey.generate()
    head, tail = issue(key).split(".")
    payload = b64url_json(head)
    payload["node_id"] = "node-b"
    forged = base64.urlsafe_b64encode(json.dumps(payload).encode()).rstrip(b"=").decode()
    with pytest.raises(Unauthenticated, match="does not verify"):
        Verifier(key.public_key).verify(f"{forged}.{tail}", node_id="node-b",
                                        operation="exec", now=NOW)


def test_signature_of_another_key_is_refused() -> None:
    credential = issue(SigningKey.generate())
    with pytest.raises(Unauthenticated, match="does not verify"):
        Verifier(SigningKey.generate().public_key).verify(
            credential, node_id="node-a", operation="exec", now=NOW)


def test_flipped_signature_bit_is_refused() -> None:
    key = SigningKey.generate()
    head, tail = issue(key).split(".")
    raw = bytearray(base64.urlsafe_b64decode(tail + "=="))
    raw[0] ^= 1
    bad = base64.urlsafe_b64encode(bytes(raw)).rstrip(b"=").decode()
    with pytest.raises(Unauthenticated, match="does not verify"):
        Verifier(key.public_key).verify(f"{head}.{bad}", node_id="node-a", operation="exec",
                                        now=NOW)


@pytest.mark.parametrize("credential", ["", "abc", "a.b.c", "!!.??", "a" * 5000,
                                        "kid-x:secret"])
def test_malformed_is_unauthenticated(credential: str) -> None:
    with pytest.raises(Unauthenticated, match="malformed"):
        Verifier(SigningKey.generate().public_key).verify(
            credential, node_id="node-a", operation="exec", now=NOW)


def test_signed_payload_missing_a_field_is_refused() -> None:
    """A validly signed payload of the wrong shape (another ctrl version) is refused,
    not half-read."""
    key = SigningKey.generate()
    claims = SessionClaims("ws-1", "inst-1", "node-a", ("exec",), int(NOW), int(NOW) + 300,
                           "cred-1")
    good = key.sign(claims)
    Verifier(key.public_key).verify(good, node_id="node-a", operation="exec", now=NOW)
    body = claims.to_json()
    del body["instance_id"]
    head = base64.urlsafe_b64encode(json.dumps(body).encode()).rstrip(b"=").decode()
    sig = base64.urlsafe_b64encode(key._key.sign(head.encode())).rstrip(b"=").decode()
    with pytest.raises(Unauthenticated, match="instance_id is missing"):
        Verifier(key.public_key).verify(f"{head}.{sig}", node_id="node-a", operation="exec",
                                        now=NOW)


def test_issue_refuses_unknown_operations() -> None:
    key = SigningKey.generate()
    with pytest.raises(InvalidArgument, match="operations"):
        issue(key, operations=["shell"])
    with pytest.raises(InvalidArgument, match="operations"):
        issue(key, operations=[])


def test_public_key_parsing() -> None:
    key = SigningKey.generate()
    assert len(base64.b64decode(key.public_key)) == 32
    parse_public_key(key.public_key)
    for bad in ("", "not base64!", base64.b64encode(b"short").decode(), None, 7):
        with pytest.raises(InvalidArgument, match="public key"):
            parse_public_key(bad)


def test_key_file_created_once_with_mode_0600(tmp_path: Path) -> None:
    path = key_path(tmp_path / "state")
    first = SigningKey.load_or_create(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    again = SigningKey.load_or_create(path)
    assert again.public_key == first.public_key
    # A credential from the first object verifies with the reloaded key's public key.
    Verifier(again.public_key).verify(issue(first), node_id="node-a", operation="exec",
                                      now=NOW)


def test_damaged_or_open_key_file_is_refused_not_replaced(tmp_path: Path) -> None:
    path = tmp_path / "session-signing.key"
    path.write_bytes(b"garbage")
    path.chmod(0o600)
    with pytest.raises(FailedPrecondition, match="not a PEM private key"):
        SigningKey.load_or_create(path)
    assert path.read_bytes() == b"garbage"
    SigningKey.load_or_create(tmp_path / "good.key")
    (tmp_path / "good.key").chmod(0o644)
    with pytest.raises(FailedPrecondition, match="chmod 600"):
        SigningKey.load_or_create(tmp_path / "good.key")
