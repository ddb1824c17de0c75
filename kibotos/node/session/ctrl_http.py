"""What the node's clients of ctrl's HTTP API share: which replica to send to, and the
error a refusal stands for.

``[node] ctrl_url`` may list several ctrl replicas (docs/replicas.md).  Each client of
ctrl in a node process (the control session, the template cache, the Transfer client,
the data plane's certificate issuer, egress's credential client) keeps one `CtrlUrls`:
it sends to `current`, and when a request to it fails in transport (the replica down,
unreachable) it calls `failed`, so its next attempt (every such client retries, or its
caller does) goes to the next replica in the list.  Staying on the replica that
answers, instead of starting from the first every time, keeps a dead first replica from
costing a connect timeout on every request.  With one URL this is that URL.

ctrl answers a refusal as ``{"error": {"code", "message", "details"}}``; `refusal`
makes that the `KibotosError` class its code names.  Anything else (a proxy's page, a
crash) is `Unavailable` with the status and the start of the body, so a caller retries.
"""

from __future__ import annotations

from collections.abc import Sequence

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


class CtrlUrls:
    """The ctrl URLs, the one in use first (the module docstring)."""

    def __init__(self, urls: str | Sequence[str]) -> None:
        listed = [urls] if isinstance(urls, str) else list(urls)
        if not listed:
            raise ValueError("no ctrl URL")
        self._urls = tuple(u.rstrip("/") for u in listed)
        self._index = 0

    @property
    def current(self) -> str:
        """The URL to send to now (no trailing slash)."""
        return self._urls[self._index]

    @property
    def all(self) -> tuple[str, ...]:
        return self._urls

    def failed(self, url: str) -> None:
        """A request to `url` failed in transport: move on, unless another request
        already did (several in flight fail together when a replica dies)."""
        if url.rstrip("/") == self.current:
            self._index = (self._index + 1) % len(self._urls)
