"""The last step of `make demo`: the official E2B SDK, configured only by the
environment ``DIR/e2b.env`` sets, against the demo's microVM.

``python -m kibotos.dev.demo_sdk SANDBOX_ID`` (with E2B_API_URL, E2B_SANDBOX_URL,
E2B_API_KEY, E2B_DOMAIN and KIBOTOS_EXPOSURE_URL set) connects to the sandbox, runs a
command, writes and reads a file, then serves that file from a web server in the
sandbox and fetches it through the Exposure gateway at ``sandbox.get_host(8000)``.
It prints one line per step, the same on every run, and leaves the sandbox running
(it is the demo's Workspace): only the web server it started is stopped.
"""

from __future__ import annotations

import os
import sys
import time

import httpx

PORT = 8000
TEXT = "written through the E2B SDK"
#: How long the sandbox's web server may take to answer (a TCG guest is slow).
SERVER_WAIT = 60.0


def _fetch_through_exposure(host: str) -> httpx.Response:
    """``GET /demo.txt`` at `host` through the Exposure gateway (Host-header routing),
    retried while the server in the sandbox is still starting (502)."""
    url = os.environ["KIBOTOS_EXPOSURE_URL"] + "/demo.txt"
    deadline = time.monotonic() + SERVER_WAIT
    while True:
        got = httpx.get(url, headers={"Host": host}, timeout=30)
        if got.status_code != 502 or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def main(argv: list[str]) -> int:
    from e2b import Sandbox  # the dev extra: make venv installs it

    if len(argv) != 1:
        print("usage: python -m kibotos.dev.demo_sdk SANDBOX_ID", file=sys.stderr)
        return 2
    sbx = Sandbox.connect(argv[0])
    ran = sbx.commands.run("echo hello from the E2B SDK")
    print(f"e2b sdk: commands.run -> {ran.stdout.strip()}")
    sbx.files.write("/tmp/demo/demo.txt", TEXT + "\n")
    print(f"e2b sdk: files.read -> {sbx.files.read('/tmp/demo/demo.txt').strip()}")
    server = sbx.commands.run(f"exec python3 -m http.server {PORT} --bind 127.0.0.1 "
                              "--directory /tmp/demo", background=True)
    try:
        host = sbx.get_host(PORT)
        got = _fetch_through_exposure(host)
        print(f"e2b sdk: GET http://{host}/demo.txt through the Exposure gateway -> "
              f"{got.status_code} {got.text.strip()}")
    finally:
        sbx.commands.kill(server.pid)
    return 0 if got.status_code == 200 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
