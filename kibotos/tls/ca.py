"""The cluster CA: one key and one self-signed certificate in ctrl's state directory,
made at the first start, from which ctrl issues its own server certificate and the
nodes' data-plane certificates.

Clients pin the CA certificate (``kibo enroll --ca-file``, ``[node] ctrl_ca_file``), so
the pair is made once and never replaced behind anyone's back:

* ``cluster-ca.key``: the private key (ECDSA P-256, PKCS#8 PEM, mode 0600), written
  first (temp, fsync, rename);
* ``cluster-ca.crt``: the certificate (PEM, mode 0644), written second.

A crash between the two leaves a key without a certificate; no client can have pinned
a certificate that was never written, so the next start makes it from the key (the
failpoint ``ctrl.ca.after-key`` is that moment).  A certificate without its key, a key
that is not the certificate's, or a key readable by others is an error naming the file:
an operator must restore the original, since every pinned copy depends on it.

P-256 rather than Ed25519: every TLS stack a client might use (browsers, curl, Go's
crypto/tls) verifies ECDSA chains, not all verify Ed25519 ones.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kibotos.core import atomicfile, failpoints, key_files
from kibotos.core.errors import FailedPrecondition, InvalidArgument

KEY_FILE = "cluster-ca.key"
CERT_FILE = "cluster-ca.crt"
#: The CA outlives every certificate it issues by far; replacing it means re-pinning
#: every client, so it is long.
CA_LIFETIME = dt.timedelta(days=3650)
#: A certificate is valid from a little before it was issued, so a client whose clock
#: is slightly behind ctrl's accepts it at once.
BACKDATE = dt.timedelta(minutes=5)
#: The most a caller may ask for one issued certificate.
MAX_LIFETIME = dt.timedelta(days=825)


def key_path(state_dir: Path | str) -> Path:
    return Path(state_dir) / KEY_FILE


def cert_path(state_dir: Path | str) -> Path:
    """The CA certificate operators copy to clients (``kibo enroll --ca-file``)."""
    return Path(state_dir) / CERT_FILE


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def subject_names(names: list[str] | tuple[str, ...]) -> list[x509.GeneralName]:
    """DNS names and IP addresses for a subjectAltName; `InvalidArgument` names a bad one."""
    out: list[x509.GeneralName] = []
    for name in names:
        if not isinstance(name, str) or not name or len(name) > 253:
            raise InvalidArgument(f"certificate name {name!r} is not a DNS name or address")
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(name.strip("[]"))))
            continue
        except ValueError:
            pass
        labels = name.rstrip(".").split(".")
        if not all(0 < len(lab) <= 63 and all(c.isalnum() or c == "-" for c in lab)
                   and not lab.startswith("-") and not lab.endswith("-") for lab in labels):
            raise InvalidArgument(f"certificate name {name!r} is not a DNS name or address")
        out.append(x509.DNSName(name.rstrip(".").lower()))
    return list(dict.fromkeys(out))


@dataclass(frozen=True)
class Issued:
    """A leaf certificate and, when the CA made the key too, its key (both PEM)."""

    cert_pem: bytes
    key_pem: bytes | None
    not_after: dt.datetime


class ClusterCA:
    """The CA key and certificate; issues server certificates."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self._key = key
        self.cert = cert
        self.cert_pem = cert_pem(cert)

    @staticmethod
    def _self_signed(key: ec.EllipticCurvePrivateKey, now: dt.datetime) -> x509.Certificate:
        # The serial names the CA in logs and in `openssl x509 -text`.
        serial = x509.random_serial_number()
        name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kibotos"),
                          x509.NameAttribute(NameOID.COMMON_NAME,
                                             f"kibotos cluster CA {serial:x}"[:64])])
        public = key.public_key()
        return (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                .public_key(public).serial_number(serial)
                .not_valid_before(now - BACKDATE).not_valid_after(now + CA_LIFETIME)
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False,
                                             key_agreement=False, key_cert_sign=True,
                                             crl_sign=True, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(public),
                               critical=False)
                .sign(key, hashes.SHA256()))

    @classmethod
    def generate(cls, now: dt.datetime | None = None) -> ClusterCA:
        """A CA in memory only (tests of clients that need one without a ctrl)."""
        key = new_key()
        return cls(key, cls._self_signed(key, now or _now()))

    @classmethod
    def load_or_create(cls, state_dir: Path | str) -> ClusterCA:
        """The CA of `state_dir`, made there on first use (see the module docstring)."""
        kpath, cpath = key_path(state_dir), cert_path(state_dir)
        key = _read_key(kpath)
        if key is None:
            if cpath.exists():
                raise FailedPrecondition(
                    f"cluster CA certificate {cpath} exists but its key {kpath} does not: "
                    "restore the key (clients pin this certificate; it is never replaced)")
            key = new_key()
            kpath.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            atomicfile.write_bytes(kpath, key_pem(key), mode=0o600)
            failpoints.hit("ctrl.ca.after-key")
        cert = _read_cert(cpath)
        if cert is None:
            cert = cls._self_signed(key, _now())
            atomicfile.write_bytes(cpath, cert_pem(cert), mode=0o644)
        elif cert.public_key() != key.public_key():
            raise FailedPrecondition(f"cluster CA certificate {cpath} is not the certificate "
                                     f"of the key {kpath}: restore the original pair")
        return cls(key, cert)

    def issue(self, names: list[str] | tuple[str, ...], *, lifetime: dt.timedelta,
              public_key: ec.EllipticCurvePublicKey | None = None,
              now: dt.datetime | None = None) -> Issued:
        """A server certificate for `names` (DNS names, IP addresses), valid for
        `lifetime`; for `public_key`, or for a new key returned with it."""
        if not names:
            raise InvalidArgument("a certificate needs at least one name or address")
        if not dt.timedelta(seconds=1) <= lifetime <= MAX_LIFETIME:
            raise InvalidArgument(f"certificate lifetime {lifetime} is outside 1 s to "
                                  f"{MAX_LIFETIME.days} days")
        sans = subject_names(names)
        new = new_key() if public_key is None else None
        public = new.public_key() if new is not None else public_key
        assert public is not None
        now = now or _now()
        not_after = min(now + lifetime, self.cert.not_valid_after_utc)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                            names[0][:64])]))
                .issuer_name(self.cert.subject).public_key(public)
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - BACKDATE).not_valid_after(not_after)
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False,
                                             key_agreement=False, key_cert_sign=False,
                                             crl_sign=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                               critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                    self._key.public_key()), critical=False)
                .sign(self._key, hashes.SHA256()))
        return Issued(cert_pem(cert), key_pem(new) if new is not None else None, not_after)


def _read_key(path: Path) -> ec.EllipticCurvePrivateKey | None:
    what = "cluster CA key"
    data = key_files.read_private_if_present(path, what)
    if data is None:
        return None
    key = key_files.load_private_key(data, path, what)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise FailedPrecondition(f"{what} {path} is not an ECDSA key")
    return key


def _read_cert(path: Path) -> x509.Certificate | None:
    data = key_files.read_if_present(path, "cluster CA certificate")
    if data is None:
        return None
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise FailedPrecondition(f"cluster CA certificate {path} is not a PEM certificate: "
                                 f"{exc}") from None
