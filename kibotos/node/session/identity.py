"""The node's identity: enrolled once with a grant, then kept in ``pki/identity.json``.

Enrollment exchanges the one-time grant (read from ``node.enrollment_grant_file``) and
the public half of a fresh Ed25519 key for a long-lived bearer credential.  A grant is
exchanged only once, so the identity file is the only copy of the credential: it is
written atomically, mode 0600, and a node that crashes between the exchange and the
write (failpoint ``node.enroll.after-exchange``) needs a new grant.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import trio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kibotos.config import NodeConfig
from kibotos.core import atomicfile, failpoints
from kibotos.core.errors import FailedPrecondition, error_from_wire
from kibotos.core.logs import EventLogger
from kibotos.node.session.backoff import Backoff
from kibotos.node.session.ctrl_http import CtrlUrls
from kibotos.tls.contexts import verification_error

log = EventLogger()

EXCHANGE_PATH = "/v1/enrollment/exchange"


@dataclass(frozen=True)
class NodeIdentity:
    identity_id: str
    credential: str
    node_id: str
    private_key_pem: str

    def private_key(self) -> Ed25519PrivateKey:
        key = serialization.load_pem_private_key(self.private_key_pem.encode(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise FailedPrecondition("node identity key is not an Ed25519 key")
        return key

    def to_json(self) -> dict[str, Any]:
        return {
            "identity_id": self.identity_id,
            "credential": self.credential,
            "node_id": self.node_id,
            "private_key": self.private_key_pem,
            "public_key": public_key_b64(self.private_key()),
        }


def public_key_b64(key: Ed25519PrivateKey) -> str:
    """The raw 32-byte public key in standard base64, as ctrl stores it."""
    raw = key.public_key().public_bytes(serialization.Encoding.Raw,
                                        serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def load_identity(path: Path) -> NodeIdentity | None:
    """The stored identity, None if the node never enrolled; a damaged file is an error
    (enrolling again needs a new grant, which is the operator's decision)."""
    damaged = ("; remove it and enroll again with a new grant from "
               "`kibo enrollment create --kind node`")
    data = atomicfile.read_json_object_if_present(
        path, lambda exc: f"cannot read node identity {path}: {exc}",
        f"node identity {path} is damaged (not a JSON object){damaged}")
    if data is None:
        return None
    try:
        identity = NodeIdentity(
            identity_id=str(data["identity_id"]),
            credential=str(data["credential"]),
            node_id=str(data["node_id"]),
            private_key_pem=str(data["private_key"]),
        )
        identity.private_key()
    except (KeyError, TypeError, ValueError) as exc:
        raise FailedPrecondition(f"node identity {path} is damaged ({exc}){damaged}") from None
    return identity


def read_grant(path: Path | None) -> str:
    if path is None:
        raise FailedPrecondition(
            "the node has no identity yet and node.enrollment_grant_file is not set: "
            "create a grant with `kibo enrollment create --kind node --node-id <id>` and "
            "name its file in node.enrollment_grant_file"
        )
    try:
        token = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise FailedPrecondition(
            f"enrollment grant file {path} does not exist: the node has no identity yet "
            "and needs a grant to enroll"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise FailedPrecondition(f"cannot read enrollment grant file {path}: {exc}") from None
    if not token:
        raise FailedPrecondition(f"enrollment grant file {path} is empty")
    return token


async def exchange_grant(client: httpx.AsyncClient, ctrl_url: str | CtrlUrls, token: str,
                         public_key: str, *, backoff: Backoff | None = None) -> dict[str, Any]:
    """POST the grant; retry while ctrl is unreachable or unavailable (the next replica
    when `ctrl_url` lists several), fail on a refusal."""
    backoff = backoff or Backoff()
    urls = ctrl_url if isinstance(ctrl_url, CtrlUrls) else CtrlUrls(ctrl_url)
    while True:
        url = urls.current + EXCHANGE_PATH
        try:
            response = await client.post(url, json={"token": token, "public_key": public_key})
        except httpx.TransportError as exc:
            unverified = verification_error(exc)
            if unverified is not None:  # a retry cannot fix it; the grant stays unused
                raise FailedPrecondition(
                    f"enrollment: ctrl at {url} presented a certificate that does not "
                    f"verify against node.ctrl_ca_file ({unverified.verify_message}); the "
                    "grant was not sent") from None
            urls.failed(urls.current)
            delay = backoff.next_delay()
            log.warning("enrollment: ctrl unreachable, retrying", url=url, error=str(exc),
                        retry_in=f"{delay:.1f}s")
            await trio.sleep(delay)
            continue
        if response.status_code >= 500:
            urls.failed(urls.current)
            delay = backoff.next_delay()
            log.warning("enrollment: ctrl unavailable, retrying", url=url,
                        status=response.status_code, retry_in=f"{delay:.1f}s")
            await trio.sleep(delay)
            continue
        try:
            body = response.json()
        except json.JSONDecodeError:
            body = None
        if response.status_code != 200:
            err = error_from_wire(body) if isinstance(body, dict) else None
            reason = err.message if err else response.text[:200]
            raise FailedPrecondition(
                f"enrollment refused by ctrl ({response.status_code}): {reason}",
                details={"code": err.code} if err else None,
            )
        result = body.get("result") if isinstance(body, dict) else None
        if not isinstance(result, dict):
            raise FailedPrecondition(f"enrollment: malformed answer from ctrl: {body!r}")
        return result


async def enroll(config: NodeConfig, path: Path, *,
                 client: httpx.AsyncClient | None = None) -> NodeIdentity:
    """Exchange the grant once and store the identity; ctrl's certificate is verified
    against ``[node] ctrl_ca_file`` before the grant is sent."""
    token = read_grant(config.node.enrollment_grant_file)
    key = Ed25519PrivateKey.generate()
    own_client = client is None
    http = client or httpx.AsyncClient(timeout=30.0, verify=config.node.ctrl_tls())
    try:
        result = await exchange_grant(http, CtrlUrls(config.node.ctrl_urls), token,
                                      public_key_b64(key))
    finally:
        if own_client:
            await http.aclose()
    if result.get("kind") != "node":
        raise FailedPrecondition(
            f"enrollment grant is for an identity of kind {result.get('kind')!r}, not a node: "
            "create one with `kibo enrollment create --kind node --node-id "
            f"{config.node.id}`"
        )
    if result.get("node_id") != config.node.id:
        raise FailedPrecondition(
            f"enrollment grant was issued for node {result.get('node_id')!r}, but this node "
            f"is {config.node.id!r} (node.id); the identity was not stored"
        )
    try:
        identity = NodeIdentity(
            identity_id=str(result["identity_id"]),
            credential=str(result["credential"]),
            node_id=config.node.id,
            private_key_pem=key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ).decode(),
        )
    except KeyError as exc:
        raise FailedPrecondition(f"enrollment: ctrl's answer lacks {exc}") from None
    failpoints.hit("node.enroll.after-exchange")
    data = identity.to_json()
    data["enrolled_at"] = datetime.now(UTC).isoformat()
    data["ctrl_url"] = config.node.ctrl_url  # as configured: one URL or the list
    atomicfile.write_json(path, data, mode=0o600)
    log.info("enrolled", node_id=config.node.id, identity_id=identity.identity_id)
    return identity


async def ensure_identity(config: NodeConfig, path: Path, *,
                          client: httpx.AsyncClient | None = None) -> NodeIdentity:
    """The stored identity, enrolling first if there is none."""
    identity = load_identity(path)
    if identity is not None:
        if identity.node_id != config.node.id:
            raise FailedPrecondition(
                f"node identity {path} belongs to node {identity.node_id!r}, but node.id is "
                f"{config.node.id!r}: a storage root belongs to one node ID"
            )
        return identity
    return await enroll(config, path, client=client)
