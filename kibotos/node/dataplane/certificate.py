"""The node's data-plane certificate: its key, the certificate ctrl issues for it, the
renewal, and the hand-over to the running data-plane process (docs/dataplane.md, "TLS").

* The key (ECDSA P-256) is made once and kept in ``<storage.root>/state/dataplane-tls.key``
  (0600, temp + fsync + rename): only its public half ever leaves the node.
* The certificate comes from ctrl, ``POST /v1/node/dataplane-certificate`` with the
  node's own credential (`CtrlIssuer`), for the host of the data-plane address the node
  reported in hello; so the first request waits for the first welcome.  It is kept
  beside the key (``dataplane-tls.crt``), so a restarted node can supply it before ctrl
  answers, and renewed once `CertificateTiming.renew_fraction` of its lifetime has
  passed, retrying with backoff while ctrl is away (a welcome retries at once).
* The running data plane gets it over its control socket (`supply_once`): the node asks
  ``status`` every `CertificateTiming.check_interval` and sends the pair when the serial
  there is not its own, which covers a renewal, a new generation and an adopted one
  alike.  The data plane loads it for new handshakes only
  (`kibotos.dataplane.process.tls_listener`).

A certificate that expired while the node was stopped is still what the data plane
serves, so new handshakes fail until the node is back: it finds the saved certificate
due, renews it and supplies the new one (spec: node-and-vmm-processes, "Data-plane
processes").
"""

from __future__ import annotations

import datetime as dt
import os
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from kibotos.core import atomicfile, failpoints
from kibotos.core.errors import FailedPrecondition, KibotosError, Unavailable
from kibotos.core.logs import EventLogger
from kibotos.dataplane.process.control import control_call
from kibotos.node.session.backoff import Backoff
from kibotos.node.session.ctrl_http import CtrlUrls, refusal
from kibotos.protocol.certificates import DataplaneCertificate
from kibotos.tls.ca import BACKDATE, key_pem, new_key

log = EventLogger()

KEY_FILE = "dataplane-tls.key"
CERT_FILE = "dataplane-tls.crt"
ISSUE_PATH = "/v1/node/dataplane-certificate"

#: Asks ctrl for a certificate of the PEM public key given.
Issuer = Callable[[str], Awaitable[DataplaneCertificate]]


@dataclass(frozen=True)
class CertificateTiming:
    renew_fraction: float = 2 / 3  # of the lifetime: then the node renews
    check_interval: float = 1.0  # how often the data plane's certificate is compared
    retry_initial: float = 1.0  # while ctrl refuses or is away
    retry_cap: float = 60.0
    control_timeout: float = 5.0


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def load_or_create_key(state_dir: Path) -> ec.EllipticCurvePrivateKey:
    """The node's data-plane key, made on first use; a key file others can read, or one
    that is not a P-256 key, is an error naming the file (it is never replaced
    silently: the certificate in use is for it)."""
    path = state_dir / KEY_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        key = new_key()
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomicfile.write_bytes(path, key_pem(key), mode=0o600)
        return key
    mode = os.stat(path).st_mode & 0o777
    if mode & 0o077:
        raise FailedPrecondition(f"data-plane key {path} has mode {mode:04o}: it must be "
                                 "readable by its owner only (chmod 600)")
    try:
        loaded = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise FailedPrecondition(f"data-plane key {path} is not a PEM private key: "
                                 f"{exc}") from None
    if not isinstance(loaded, ec.EllipticCurvePrivateKey) \
            or loaded.curve.name != "secp256r1":
        raise FailedPrecondition(f"data-plane key {path} is not an ECDSA P-256 key: "
                                 "remove it and the node makes a new one")
    return loaded


def public_pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def renew_at(cert: x509.Certificate, fraction: float) -> dt.datetime:
    """When `fraction` of the certificate's lifetime has passed.  Its start is the
    issue time: the CA backdates ``not_before`` by `BACKDATE`, which is no lifetime."""
    end = cert.not_valid_after_utc
    start = min(cert.not_valid_before_utc + BACKDATE, end)
    return start + (end - start) * fraction


class CtrlIssuer:
    """`Issuer` through ctrl's API with the node's bearer credential."""

    def __init__(self, ctrl_url: str | Sequence[str], credential: Callable[[], str | None],
                 verify: ssl.SSLContext, *, timeout: float = 30.0) -> None:
        #: ctrl's replicas: an issue that cannot reach one is retried on the next.
        self.urls = CtrlUrls(ctrl_url)
        self._credential = credential
        self._verify = verify
        self._timeout = timeout

    async def __call__(self, public_key: str) -> DataplaneCertificate:
        credential = self._credential()
        if credential is None:
            raise Unavailable("the node has no credential yet to ask ctrl for a data-plane "
                              "certificate")
        base = self.urls.current
        try:
            async with httpx.AsyncClient(verify=self._verify, timeout=self._timeout) as http:
                resp = await http.post(base + ISSUE_PATH, json={"public_key": public_key},
                                       headers={"Authorization": f"Bearer {credential}"})
                await resp.aread()
        except httpx.TransportError as exc:
            self.urls.failed(base)
            raise Unavailable(f"cannot reach ctrl at {base}{ISSUE_PATH}: "
                              f"{exc or type(exc).__name__}") from None
        if resp.status_code != 200:
            raise refusal(resp, "ctrl refused a data-plane certificate")
        try:
            return DataplaneCertificate.model_validate(resp.json()["result"])
        except (ValueError, KeyError, TypeError) as exc:
            raise Unavailable(f"ctrl's data-plane certificate answer is malformed: "
                              f"{exc}") from None


class CertificateKeeper:
    """See the module docstring.  `run` in the node's nursery beside the supervisor."""

    def __init__(self, *, state_dir: Path, control: Path, issue: Issuer,
                 timing: CertificateTiming | None = None,
                 now: Callable[[], dt.datetime] = _now) -> None:
        self.state_dir = state_dir
        self.control = control
        self.issue = issue
        self.timing = timing or CertificateTiming()
        self.now = now
        self.key: ec.EllipticCurvePrivateKey | None = None
        self.cert: x509.Certificate | None = None
        self.cert_pem: bytes | None = None
        self.renewals = 0  # certificates obtained by this node process
        self._welcomed = trio.Event()
        self._wake = trio.Event()  # a welcome: retry at once
        self._changed = trio.Event()  # a new certificate: supply at once
        self._backoff = Backoff(initial=self.timing.retry_initial, cap=self.timing.retry_cap)
        self._supply_failing = False

    @property
    def serial(self) -> str | None:
        return None if self.cert is None else f"{self.cert.serial_number:x}"

    def not_after_timestamp(self) -> float | None:
        """The end of the certificate in use (Unix seconds), for the node's metrics."""
        return None if self.cert is None else self.cert.not_valid_after_utc.timestamp()

    def on_welcome(self) -> None:
        """ctrl answered hello, so it knows the address to certify: ask now."""
        self._welcomed.set()
        self._wake.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        self.key = await trio.to_thread.run_sync(load_or_create_key, self.state_dir)
        self._load_saved()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._renew_loop)
            nursery.start_soon(self._supply_loop)
            task_status.started()

    # ------------------------------------------------------------------ renewal

    def _load_saved(self) -> None:
        path = self.state_dir / CERT_FILE
        try:
            pem = path.read_bytes()
            cert = x509.load_pem_x509_certificate(pem)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.warning("ignoring the saved data-plane certificate", path=path,
                        error=str(exc))
            return
        assert self.key is not None
        if cert.public_key() != self.key.public_key():
            log.warning("ignoring the saved data-plane certificate: it is not for the "
                        "node's data-plane key", path=path)
            return
        self.cert, self.cert_pem = cert, pem

    def due(self) -> bool:
        return self.cert is None or self.now() >= renew_at(self.cert,
                                                           self.timing.renew_fraction)

    async def _renew_loop(self) -> None:
        await self._welcomed.wait()
        while True:
            if self.due():
                try:
                    await self.renew()
                except KibotosError as exc:
                    delay = self._backoff.next_delay()
                    log.warning("data-plane certificate not renewed", error=exc.message,
                                retry_in=f"{delay:.1f}s", serial=self.serial)
                    await self._sleep(delay)
                    continue
                self._backoff.reset()
            assert self.cert is not None
            wait = (renew_at(self.cert, self.timing.renew_fraction) - self.now())
            await self._sleep(max(0.05, min(wait.total_seconds(), 3600.0)))

    async def _sleep(self, seconds: float) -> None:
        """`seconds`, or less when a welcome comes (ctrl is back: try now)."""
        self._wake = trio.Event()
        with trio.move_on_after(seconds):
            await self._wake.wait()

    async def renew(self) -> None:
        """One certificate from ctrl for the node's key, kept and handed on."""
        assert self.key is not None
        got = await self.issue(public_pem(self.key))
        try:
            cert = x509.load_pem_x509_certificate(got.certificate.encode())
        except ValueError as exc:
            raise Unavailable(f"ctrl sent a data-plane certificate that is not PEM: "
                              f"{exc}") from None
        if cert.public_key() != self.key.public_key():
            raise Unavailable("ctrl sent a data-plane certificate for another key")
        pem = got.certificate.encode()
        await trio.to_thread.run_sync(atomicfile.write_bytes, self.state_dir / CERT_FILE,
                                      pem)
        # A crash here leaves the new certificate saved and the data plane with the old
        # one (or none): the next start loads the saved one and supplies it.
        failpoints.hit("node.dataplane-cert.after-save")
        self.cert, self.cert_pem = cert, pem
        self.renewals += 1
        log.info("data-plane certificate obtained", serial=self.serial,
                 not_after=cert.not_valid_after_utc.isoformat(), names=got.names)
        self._changed.set()

    # ------------------------------------------------------------------ the data plane

    async def _supply_loop(self) -> None:
        while True:
            self._changed = trio.Event()
            await self.supply_once()
            with trio.move_on_after(self.timing.check_interval):
                await self._changed.wait()

    async def supply_once(self) -> bool:
        """Send the certificate to the running data plane unless it has it; True when
        it has it afterwards.  No data plane, or one serving plain: nothing to do."""
        if self.cert_pem is None or self.key is None:
            return False
        try:
            status = await control_call(self.control, {"type": "status"},
                                        timeout=self.timing.control_timeout)
            if status.get("tls") is not True:
                return False
            if status.get("certificate_serial") == self.serial:
                return True
            await control_call(self.control, {
                "type": "certificate", "certificate": self.cert_pem.decode(),
                "key": key_pem(self.key).decode()}, timeout=self.timing.control_timeout)
        except KibotosError as exc:
            if not self._supply_failing:  # once per streak: the supervisor restarts it
                log.warning("data-plane certificate not supplied", error=exc.message,
                            serial=self.serial)
            self._supply_failing = True
            return False
        self._supply_failing = False
        log.info("data-plane certificate supplied", generation=status.get("generation"),
                 serial=self.serial, replaced=status.get("certificate_serial"))
        return True
