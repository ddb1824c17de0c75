"""ctrl's HTTPS: which certificate the API serves, and keeping it current.

``[tls]`` of ctrl.toml (docs/enrollment.md, "TLS") chooses:

* the operator's certificate (``cert_file`` + ``key_file``): loaded at start and
  loaded again whenever either file changes, so the operator's own renewal (certbot,
  an internal PKI) needs no restart;
* else a certificate ctrl issues itself from the cluster CA for `server_names`, kept
  as ``<state_dir>/ctrl-server.crt`` and ``ctrl-server.key``: issued at every start
  (the names may have changed) and renewed while ctrl runs once a third of its
  lifetime is left;
* or, with ``enabled = false`` (loopback listen addresses only), plain HTTP.

Both loads go into the one SSL context the listener uses, so new handshakes get the
new certificate and established connections keep theirs.
"""

from __future__ import annotations

import datetime as dt
import logging
import socket
from pathlib import Path

import trio

from kibotos.config import CtrlConfig
from kibotos.core.errors import InvalidArgument, KibotosError
from kibotos.tls.ca import ClusterCA, subject_names
from kibotos.tls.server import ServerCertificate, due, write_pair

log = logging.getLogger("kibotos.ctrl")

CERT_FILE = "ctrl-server.crt"
KEY_FILE = "ctrl-server.key"
#: Lifetime of the certificate ctrl issues itself.
LIFETIME = dt.timedelta(days=90)
#: How often the certificate's files and age are looked at.
CHECK_INTERVAL = 3600.0
_WILDCARDS = {"", "0.0.0.0", "::", "[::]", "*"}


def server_names(config: CtrlConfig) -> list[str]:
    """The names of ctrl's issued certificate: the configured ones first, the listen
    host (unless it is a wildcard), this host's name, then loopback."""
    host = config.ctrl.listen.rpartition(":")[0].strip("[]")
    names = [*config.tls.server_names]
    if host not in _WILDCARDS:
        names.append(host)
    hostname = socket.gethostname()
    if hostname and hostname != "localhost":
        try:
            subject_names([hostname])  # a host name that is no DNS name is left out
            names.append(hostname)
        except InvalidArgument:
            pass
    names += ["localhost", "127.0.0.1", "::1"]
    return list(dict.fromkeys(names))


class CtrlTls:
    """The API's certificate; `prepare` loads it, `run` keeps it current."""

    def __init__(self, config: CtrlConfig, ca: ClusterCA) -> None:
        self.config = config
        self.ca = ca
        state_dir = Path(config.ctrl.state_dir)
        self.operator = config.tls.cert_file is not None
        if config.tls.cert_file is not None and config.tls.key_file is not None:
            self.server = ServerCertificate(config.tls.cert_file, config.tls.key_file)
        else:
            self.server = ServerCertificate(state_dir / CERT_FILE, state_dir / KEY_FILE)
        self._seen: tuple[float, float] | None = None

    def _stamp(self) -> tuple[float, float]:
        return (self.server.cert_file.stat().st_mtime, self.server.key_file.stat().st_mtime)

    def issue(self, now: dt.datetime | None = None) -> None:
        """Issue ctrl's certificate from the cluster CA, write it, and serve it."""
        issued = self.ca.issue(server_names(self.config), lifetime=LIFETIME, now=now)
        assert issued.key_pem is not None
        write_pair(self.server.cert_file, self.server.key_file, issued.cert_pem,
                   issued.key_pem)
        self.server.load()
        log.info("ctrl: serving a certificate from the cluster CA for %s, valid until %s",
                 ", ".join(server_names(self.config)), issued.not_after.isoformat())

    def prepare(self) -> None:
        """Load (or issue) the certificate before the listener starts; a pair that does
        not load is an error naming its files."""
        if self.operator:
            self.server.load()
            self._seen = self._stamp()
            log.info("ctrl: serving the certificate %s, valid until %s",
                     self.server.cert_file, self.server.not_after)
        else:
            self.issue()

    def check(self, now: dt.datetime | None = None) -> None:
        """One look: reload the operator's files if they changed, renew an issued
        certificate that is due.  A failed reload keeps the certificate being served
        and is logged; the next look tries again."""
        try:
            if self.operator:
                stamp = self._stamp()
                if stamp != self._seen:
                    self.server.load()
                    self._seen = stamp
                    log.info("ctrl: %s changed, now serving it (valid until %s)",
                             self.server.cert_file, self.server.not_after)
            elif due(self.server.cert_file.read_bytes(),
                     now=now or dt.datetime.now(dt.UTC), lifetime=LIFETIME):
                self.issue(now)
        except (KibotosError, OSError) as exc:  # a broken file must not end ctrl
            log.error("ctrl: TLS certificate not renewed, the current one stays: %s", exc)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
                  interval: float = CHECK_INTERVAL) -> None:
        task_status.started()
        while True:
            await trio.sleep(interval)
            await trio.to_thread.run_sync(self.check)
