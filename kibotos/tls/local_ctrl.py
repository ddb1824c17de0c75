"""How a client on ctrl's own host (the dev cluster, tests, benchmarks) reaches a ctrl
whose configuration it has: the URL of the address ctrl bound, and the CA to verify it
with.  Remote clients are given these by the operator instead (docs/enrollment.md)."""

from __future__ import annotations

import ssl
from pathlib import Path

from kibotos.config import CtrlConfig
from kibotos.tls.ca import cert_path
from kibotos.tls.contexts import client_context, read_ca_file


def ctrl_url(config: CtrlConfig, address: str) -> str:
    """``https://host:port``, or ``http://`` when ctrl serves plain HTTP."""
    return f"{'https' if config.tls.enabled else 'http'}://{address}"


def ca_file(config: CtrlConfig) -> Path | None:
    """The CA file that verifies ctrl's certificate: the cluster CA's when ctrl issues
    its own; None for plain HTTP or the operator's certificate (whose CA the operator
    knows)."""
    if not config.tls.enabled or config.tls.cert_file is not None:
        return None
    return cert_path(config.ctrl.state_dir)


def client_tls(config: CtrlConfig) -> ssl.SSLContext:
    """A context verifying this ctrl (the system store when `ca_file` is None)."""
    path = ca_file(config)
    return client_context(None if path is None else read_ca_file(path, "cluster CA"))
