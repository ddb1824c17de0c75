"""The error a refusal of ctrl's HTTP API stands for, as the node's HTTP clients of it
(template cache, Transfer archives) report it.

ctrl answers a refusal as ``{"error": {"code", "message", "details"}}``; that becomes
the `KibotosError` class its code names.  Anything else (a proxy's page, a crash) is
`Unavailable` with the status and the start of the body, so a caller retries it.
"""

from __future__ import annotations

import httpx

from kibotos.core.errors import KibotosError, Unavailable, error_from_wire


def refusal(resp: httpx.Response, what: str) -> KibotosError:
    """The error `resp` (read, not 2xx) stands for, its message led by `what`."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = error_from_wire(body)
    else:
        err = Unavailable(f"HTTP {resp.status_code}: {resp.text[:200]}")
    err.message = f"{what}: {err.message}"
    return err
