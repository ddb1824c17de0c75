"""The agent on AF_VSOCK (``--vsock PORT``), as a Firecracker guest runs it.

This host has the AF_VSOCK socket family but no transport that connects (no
vhost-vsock, no vsock loopback), so a connection cannot be made here; what can be
checked is that the agent really listens on the port it was given (the port is taken
until it stops) and refuses a port out of range.  A connection over vsock is what the
Firecracker stand-in's ``CONNECT`` forwarding stands for (tests/firecracker).
"""

from __future__ import annotations

import errno
import socket
import subprocess
import time
from pathlib import Path

import pytest
from guest_harness import GUEST_PYTHON, TIMEOUT

from kibotos.guest import AGENT_PATH


def _vsock_available() -> bool:
    try:
        socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM).close()
    except (AttributeError, OSError):
        return False
    return True


pytestmark = pytest.mark.skipif(not _vsock_available(),
                                reason="this kernel has no AF_VSOCK sockets")


def _free_port() -> int:
    with socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM) as s:
        s.bind((socket.VMADDR_CID_ANY, socket.VMADDR_PORT_ANY))
        port: int = s.getsockname()[1]
        return port


def _port_taken(port: int) -> bool:
    with socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM) as s:
        try:
            s.bind((socket.VMADDR_CID_ANY, port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            return True
        return False


def test_the_agent_listens_on_its_vsock_port_until_it_stops(tmp_path: Path) -> None:
    port = _free_port()
    log = tmp_path / "agent.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([GUEST_PYTHON, str(AGENT_PATH), "--vsock", str(port),
                                 "--root", str(tmp_path)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + TIMEOUT
        while f"listening on vsock port {port}" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert _port_taken(port)
    finally:
        proc.terminate()
        assert proc.wait(TIMEOUT) == 0
    assert not _port_taken(port)


@pytest.mark.parametrize("port", ["0", "4294967295"])
def test_a_vsock_port_out_of_range_is_refused_with_the_reason(tmp_path: Path,
                                                              port: str) -> None:
    done = subprocess.run([GUEST_PYTHON, str(AGENT_PATH), "--vsock", port, "--root",
                           str(tmp_path)], capture_output=True, text=True, timeout=TIMEOUT,
                          check=False)
    assert done.returncode != 0
    assert f"vsock port {port} is out of range" in done.stderr
