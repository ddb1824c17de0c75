"""A real ctrl process on loopback for the CLI's integration tests.

Started with ``kibotos ctrl serve`` on 127.0.0.1 port 0; the bound address is read
from ``<state_dir>/listen-address``.  ctrl serves HTTPS with a certificate from its
cluster CA (``ca_file``, which ``kibo enroll --ca-file`` pins).  Grants come from
``kibotos ctrl grant``, the way the first operator gets in.
"""

from __future__ import annotations

import base64
import os
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kibotos.tls.contexts import client_context

BIN = Path(sys.executable).parent
START_TIMEOUT = 60.0


def kibotos_argv(*args: str) -> list[str]:
    exe = BIN / "kibotos"
    if exe.exists():
        return [str(exe), *args]
    return [sys.executable, "-m", "kibotos.cli.main", *args]


class CtrlProcess:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.state_dir = root / "state"
        self.config = root / "ctrl.toml"
        self.config.write_text(
            "[ctrl]\n"
            'listen = "127.0.0.1:0"\n'
            f'state_dir = "{self.state_dir}"\n'
            'reconcile_interval = "1h"\n'
            "[testing]\n"
            'pool_capacity = "1T"\n'
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        #: The cluster CA ctrl makes at its first start; it verifies ctrl's certificate.
        self.ca_file = self.state_dir / "cluster-ca.crt"

    def start(self) -> CtrlProcess:
        address_file = self.state_dir / "listen-address"
        log = open(self.root / "ctrl.log", "ab")  # noqa: SIM115 - kept by the process
        self.proc = subprocess.Popen(
            kibotos_argv("ctrl", "serve", "--config", str(self.config)),
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if address_file.exists() and address_file.read_text().endswith("\n"):
                self.url = "https://" + address_file.read_text().strip()
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"ctrl exited with {self.proc.returncode}:\n"
                                   f"{(self.root / 'ctrl.log').read_text()[-3000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("ctrl did not write its listen address within "
                                   f"{START_TIMEOUT:g}s")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.proc = None

    def tls(self) -> ssl.SSLContext:
        """A context that verifies this ctrl (with its cluster CA)."""
        return client_context(self.ca_file.read_bytes())

    def enroll_args(self) -> list[str]:
        """``kibo enroll`` options that reach this ctrl and pin its CA."""
        return ["--ctrl-url", self.url, "--ca-file", str(self.ca_file)]

    def grant(self, kind: str, node_id: str | None = None) -> str:
        argv = kibotos_argv("ctrl", "grant", "--config", str(self.config), "--kind", kind)
        if node_id:
            argv += ["--node-id", node_id]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def enroll_node(self, node_id: str) -> str:
        """Exchange a node grant the way a node does; creates the Node record."""
        key = Ed25519PrivateKey.generate()
        public = base64.b64encode(key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw)).decode()
        response = httpx.post(f"{self.url}/v1/enrollment/exchange",
                              json={"token": self.grant("node", node_id),
                                    "public_key": public}, timeout=30,
                              verify=self.tls())
        response.raise_for_status()
        return str(response.json()["result"]["identity_id"])
