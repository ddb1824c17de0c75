"""The cluster CA (kibotos/tls/ca.py): made once in the state directory, with the key
0600; reloaded unchanged; a crash between key and certificate recovered; a broken or
mismatched pair refused, never replaced; the certificates it issues verify in a real
TLS handshake (OpenSSL over memory BIOs) for their names only, and not once expired."""

from __future__ import annotations

import datetime as dt
import os
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from kibotos.core.errors import FailedPrecondition, InvalidArgument
from kibotos.tls.ca import ClusterCA, Issued, cert_path, key_path
from kibotos.tls.contexts import client_context
from kibotos.tls.server import ServerCertificate, due, write_pair


def handshake(server: ssl.SSLContext, client: ssl.SSLContext, name: str) -> None:
    """A full TLS handshake between the two contexts; raises the client's error."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    cli = client.wrap_bio(c_in, c_out, server_hostname=name)
    srv = server.wrap_bio(s_in, s_out, server_side=True)
    done = {"c": False, "s": False}
    for _ in range(20):
        for side, obj in (("c", cli), ("s", srv)):
            if not done[side]:
                try:
                    obj.do_handshake()
                    done[side] = True
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLError:
                    if side == "s":  # the client's alert explains it better
                        s_in.write(b"")
                        continue
                    raise
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            return
    cli.do_handshake()  # raises what stopped it


def serving(tmp_path: Path, issued: Issued) -> ServerCertificate:
    assert issued.key_pem is not None
    server = ServerCertificate(tmp_path / "s.crt", tmp_path / "s.key")
    write_pair(server.cert_file, server.key_file, issued.cert_pem, issued.key_pem)
    server.load()
    return server


def test_made_once_key_private_and_reloaded_unchanged(tmp_path: Path) -> None:
    state = tmp_path / "state"
    ca = ClusterCA.load_or_create(state)
    assert os.stat(key_path(state)).st_mode & 0o777 == 0o600
    assert cert_path(state).read_bytes() == ca.cert_pem
    again = ClusterCA.load_or_create(state)
    assert again.cert_pem == ca.cert_pem
    assert not [p.name for p in state.iterdir() if p.name.endswith(".tmp")]


def test_crash_between_key_and_certificate_is_recovered(tmp_path: Path) -> None:
    state = tmp_path / "state"
    env = {**os.environ, "KIBOTOS_FAILPOINTS": "ctrl.ca.after-key=kill"}
    proc = subprocess.run([sys.executable, "-c",
                           "import sys; from kibotos.tls.ca import ClusterCA; "
                           "ClusterCA.load_or_create(sys.argv[1])", str(state)],
                          env=env, capture_output=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    assert key_path(state).exists()
    assert not cert_path(state).exists()
    key_before = key_path(state).read_bytes()
    ca = ClusterCA.load_or_create(state)
    assert key_path(state).read_bytes() == key_before
    assert ca.cert.public_key() == ClusterCA.load_or_create(state).cert.public_key()


def test_certificate_without_its_key_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    ClusterCA.load_or_create(state)
    key_path(state).unlink()
    with pytest.raises(FailedPrecondition, match="exists but its key"):
        ClusterCA.load_or_create(state)
    assert cert_path(state).exists()


def test_mismatched_pair_and_open_key_are_refused(tmp_path: Path) -> None:
    one, other = tmp_path / "one", tmp_path / "other"
    ClusterCA.load_or_create(one)
    ClusterCA.load_or_create(other)
    cert_path(one).write_bytes(cert_path(other).read_bytes())
    with pytest.raises(FailedPrecondition, match="is not the certificate of the key"):
        ClusterCA.load_or_create(one)
    os.chmod(key_path(other), 0o644)
    with pytest.raises(FailedPrecondition, match="chmod 600"):
        ClusterCA.load_or_create(other)


def test_issued_certificate_verifies_for_its_names_only(tmp_path: Path) -> None:
    ca = ClusterCA.load_or_create(tmp_path / "state")
    server = serving(tmp_path, ca.issue(["ctrl.example", "127.0.0.1"],
                                        lifetime=dt.timedelta(days=1)))
    trusting = client_context(ca.cert_pem)
    handshake(server.context, trusting, "ctrl.example")
    handshake(server.context, trusting, "127.0.0.1")
    with pytest.raises(ssl.SSLCertVerificationError, match="mismatch"):
        handshake(server.context, trusting, "other.example")
    stranger = client_context(ClusterCA.generate().cert_pem)
    with pytest.raises(ssl.SSLCertVerificationError, match="unable to get local issuer"):
        handshake(server.context, stranger, "ctrl.example")


def test_expired_certificate_fails_and_a_reload_replaces_it(tmp_path: Path) -> None:
    ca = ClusterCA.generate()
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=2)
    server = serving(tmp_path, ca.issue(["localhost"], lifetime=dt.timedelta(hours=1),
                                        now=past))
    trusting = client_context(ca.cert_pem)
    with pytest.raises(ssl.SSLCertVerificationError, match="expired"):
        handshake(server.context, trusting, "localhost")
    fresh = ca.issue(["localhost"], lifetime=dt.timedelta(hours=1))
    assert fresh.key_pem is not None
    write_pair(server.cert_file, server.key_file, fresh.cert_pem, fresh.key_pem)
    server.load()  # into the same context: no new listener
    handshake(server.context, trusting, "localhost")


def test_renewal_is_due_when_a_third_of_the_lifetime_is_left() -> None:
    ca = ClusterCA.generate()
    now = dt.datetime.now(dt.UTC)
    cert = ca.issue(["localhost"], lifetime=dt.timedelta(days=30), now=now).cert_pem
    assert not due(cert, now=now + dt.timedelta(days=19), lifetime=dt.timedelta(days=30))
    assert due(cert, now=now + dt.timedelta(days=21), lifetime=dt.timedelta(days=30))


@pytest.mark.parametrize("names", [[], ["bad name"], ["-x.example"], [""]])
def test_bad_names_are_refused(names: list[str]) -> None:
    with pytest.raises(InvalidArgument):
        ClusterCA.generate().issue(names, lifetime=dt.timedelta(days=1))
