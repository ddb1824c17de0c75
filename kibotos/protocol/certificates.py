"""The data-plane certificate a node asks ctrl for (``POST /v1/node/dataplane-certificate``
with the node's own credential; docs/dataplane.md, "TLS").

The node keeps its private key: it sends only the public half, and ctrl signs a
certificate for that key and for the host of the data-plane address the node reported
in its latest hello, chained to the cluster CA.  Both sides build and parse these
shapes, so the rules are one.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from pydantic import BaseModel, ConfigDict, Field, field_validator

#: A PEM P-256 public key is about 180 characters; a certificate about 800.
MAX_PUBLIC_KEY = 1024
MAX_PEM = 16384


def load_public_key(pem: str) -> ec.EllipticCurvePublicKey:
    """The ECDSA P-256 public key of `pem`; `ValueError` naming what is wrong."""
    try:
        key = serialization.load_pem_public_key(pem.encode())
    except (ValueError, TypeError) as exc:
        raise ValueError(f"public_key is not a PEM public key: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
        raise ValueError("public_key must be an ECDSA P-256 key")
    return key


class DataplaneCertificateRequest(BaseModel):
    """node → ctrl: the public key to certify (PEM, SubjectPublicKeyInfo)."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    public_key: str = Field(max_length=MAX_PUBLIC_KEY)

    @field_validator("public_key")
    @classmethod
    def _p256(cls, v: str) -> str:
        load_public_key(v)
        return v


class DataplaneCertificate(BaseModel):
    """ctrl → node: the certificate (PEM), the cluster CA it chains to (PEM), its end of
    validity (RFC 3339 UTC) and the names it carries."""

    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")

    certificate: str = Field(max_length=MAX_PEM)
    ca: str = Field(max_length=MAX_PEM)
    not_after: str
    names: list[str]


def dataplane_url(address: str) -> str:
    """The base URL of a data plane from the address its node reported in hello:
    ``https://host:port`` as it is (TLS), a bare ``host:port`` as ``http://`` (plain,
    loopback only)."""
    return address if address.startswith("https://") else f"http://{address}"


def dataplane_host(address: str) -> str:
    """The host of a reported data-plane address (either form), without brackets."""
    netloc = urlsplit(address).netloc if "://" in address else address
    return netloc.rpartition(":")[0].strip("[]")
