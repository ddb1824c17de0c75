"""The Exposure gateway tests' and bench's helper: the test server
(`exposure_server.py`) started in a sandbox and waited for through the gateway."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
from e2b import Sandbox
from gateway_proc import E2bSetup

from kibotos.testing.waiting import wait_until_sync

SERVER = (Path(__file__).parent / "exposure_server.py").read_text()
#: What ``GET /blob?n=N`` repeats.
PATTERN = bytes(range(256)) * 256


def free_port() -> int:
    """A port nothing on this host listens on now (the test VMM's guest shares the
    host's loopback)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(e2b: E2bSetup, sbx: Sandbox, token: str | None = None) -> int:
    """Start the test server in `sbx`; its port, once it answers through the gateway."""
    port = free_port()
    sbx.commands.run(f'exec python3 -c "$EXPOSURE_SERVER" {port}',
                     envs={"EXPOSURE_SERVER": SERVER}, background=True)
    headers = {"Host": sbx.get_host(port)}
    if token:
        headers["e2b-traffic-access-token"] = token

    def answers() -> httpx.Response | None:
        got = httpx.get(f"{e2b.gateway.exposure_url}/hello", headers=headers)
        return got if got.status_code == 200 else None

    wait_until_sync(answers, "the sandbox's server answers through the gateway", timeout=60)
    return port


def gateway_pid(e2b: E2bSetup) -> int:
    return int((e2b.cluster.dir / "gateway-exposure/gateway.pid").read_text().split()[0])
