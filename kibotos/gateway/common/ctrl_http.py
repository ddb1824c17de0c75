"""A gateway's client of ctrl's HTTP API, as its own operator identity: one call, the
Workspaces it reads, and the data-plane session credentials it works with.

Everything foreign becomes `kibotos.core.errors` here, as in the CLI's client: ctrl's
``{"error": …}`` the class its code names, a refused connection `Unavailable`, a
timeout `DeadlineExceeded`, a certificate that does not verify `FailedPrecondition`
(retrying cannot fix it).  Writes carry a command ID, so ctrl replays a write whose
answer was lost instead of doing it twice.  Session credentials are cached, per
Workspace and set of operations, until `SESSION_MARGIN` before they expire.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import httpx

from kibotos.core.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    Unavailable,
    error_from_wire,
)
from kibotos.core.ids import new_id
from kibotos.tls.contexts import client_context, verification_error

#: A cached session credential is replaced this long before it expires.
SESSION_MARGIN = 60.0
REQUEST_TIMEOUT = 90.0


@dataclass(frozen=True)
class DataplaneSession:
    url: str
    credential: str
    expires_at: float  # monotonic
    #: What an ``https://`` data plane is verified with (None for plain ``http://``).
    tls: ssl.SSLContext | None = None


class CtrlHttp:
    def __init__(self, base_url: str, credential: str, *, user_agent: str,
                 command_prefix: str, transport: httpx.AsyncBaseTransport | None = None,
                 verify: ssl.SSLContext | None = None,
                 dataplane_verify: ssl.SSLContext | None = None) -> None:
        """`verify` checks ctrl's certificate, `dataplane_verify` the nodes' data-plane
        certificates (default for both: the system trust store); `command_prefix` starts
        the command IDs of this gateway's writes."""
        self.base_url = base_url.rstrip("/")
        self._dataplane_verify = dataplane_verify
        self._command_prefix = command_prefix
        self._http = httpx.AsyncClient(
            base_url=self.base_url, transport=transport, follow_redirects=False,
            verify=verify or client_context(),
            headers={"Authorization": f"Bearer {credential}", "User-Agent": user_agent})
        self._sessions: dict[tuple[str, tuple[str, ...]], DataplaneSession] = {}

    async def aclose(self) -> None:
        await self._http.aclose()

    async def call(self, method: str, path: str, *, body: dict[str, Any] | None = None,
                   params: dict[str, Any] | None = None, write: bool = False,
                   timeout: float = REQUEST_TIMEOUT) -> Any:
        """``result`` of one call; `write` adds a fresh command ID."""
        if write:
            body = {**(body or {}), "command_id": new_id(self._command_prefix)}
        try:
            response = await self._http.request(method, path, json=body, params=params,
                                                timeout=timeout)
        except httpx.TimeoutException:
            raise DeadlineExceeded(f"ctrl did not answer {method} {path} within "
                                   f"{timeout:g}s") from None
        except httpx.TransportError as exc:
            unverified = verification_error(exc)
            if unverified is not None:  # retrying cannot fix it
                raise FailedPrecondition(
                    f"ctrl at {self.base_url} presented a certificate that does not verify "
                    f"against ctrl.ca_file ({unverified.verify_message}): give the gateway "
                    "ctrl's CA (ctrl's <state_dir>/cluster-ca.crt unless the operator gave "
                    "ctrl a certificate)") from None
            raise Unavailable(f"cannot reach ctrl at {self.base_url}: {exc}") from None
        try:
            answer = response.json()
        except ValueError:
            raise Internal(f"ctrl answered {method} {path} with HTTP "
                           f"{response.status_code} and no JSON") from None
        if response.status_code != 200:
            raise error_from_wire(answer)
        return answer.get("result") if isinstance(answer, dict) else None

    async def workspace(self, workspace_id: str, *, wait_s: int | None = None
                        ) -> dict[str, Any]:
        params = None if wait_s is None else {"wait_s": wait_s}
        return dict(await self.call("GET", workspace_path(workspace_id), params=params,
                                    timeout=REQUEST_TIMEOUT + (wait_s or 0)))

    async def act(self, workspace_id: str, action: str, **body: Any) -> dict[str, Any]:
        """``start``, ``stop`` (``force=True`` allowed), ``delete`` or ``set-network``;
        the Workspace's cached session credentials are dropped first."""
        self.forget_session(workspace_id)
        return dict(await self.call("POST", workspace_path(workspace_id, action), body=body,
                                    write=True))

    async def dataplane_session(self, workspace_id: str, operations: Sequence[str]
                                ) -> DataplaneSession:
        """A data-plane URL and a credential granting `operations` on the Workspace."""
        key = (workspace_id, tuple(sorted(operations)))
        cached = self._sessions.get(key)
        if cached is not None and time.monotonic() < cached.expires_at:
            return cached
        got = await self.call("POST", workspace_path(workspace_id, "sessions"),
                              body={"operations": list(key[1])})
        lifetime = _seconds_until(str(got["expires_at"]))
        url = str(got["dataplane_url"])
        tls = (self._dataplane_verify or client_context()) if url.startswith("https://") \
            else None
        made = DataplaneSession(url, str(got["credential"]),
                                time.monotonic() + max(0.0, lifetime - SESSION_MARGIN), tls)
        if len(self._sessions) > 4096:
            self._sessions.clear()
        self._sessions[key] = made
        return made

    def forget_session(self, workspace_id: str) -> None:
        """Drop the Workspace's cached credentials (it moved, stopped or went away)."""
        for key in [k for k in self._sessions if k[0] == workspace_id]:
            del self._sessions[key]


def workspace_path(workspace_id: str, action: str = "") -> str:
    path = f"/v1/workspaces/{quote(workspace_id, safe='')}"
    return f"{path}/{action}" if action else path


def _seconds_until(stamp: str) -> float:
    try:
        at = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        raise Internal(f"ctrl sent a session expiry that is not a time: {stamp!r}") from None
    return (at - datetime.now(UTC)).total_seconds()
