"""The gateway's client of ctrl's HTTP API: keys, Workspaces, data-plane sessions.

The gateway calls ctrl as its own operator identity.  Everything foreign becomes
`kibotos.errors` here, as in the CLI's client: ctrl's ``{"error": …}`` the class its
code names, a refused connection `Unavailable`, a timeout `DeadlineExceeded`.  Writes
carry a command ID, so ctrl replays a write whose answer was lost instead of doing it
twice.

Two short-lived caches keep the common path to one ctrl call or none: verified keys
(`KEY_TTL`: a revoke takes effect within it) and data-plane session credentials (used
until `SESSION_MARGIN` before they expire).
"""

from __future__ import annotations

import ssl
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import httpx

from kibotos.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    Unauthenticated,
    Unavailable,
    error_from_wire,
)
from kibotos.ids import new_id
from kibotos.tls.contexts import client_context, verification_error

#: How long a verified key is trusted without asking ctrl again.
KEY_TTL = 5.0
#: A cached session credential is replaced this long before it expires.
SESSION_MARGIN = 60.0
REQUEST_TIMEOUT = 90.0


@dataclass(frozen=True)
class Team:
    """Who presented a key: the key and the team it belongs to."""

    key_id: str
    name: str
    team: str


@dataclass(frozen=True)
class DataplaneSession:
    url: str
    credential: str
    expires_at: float  # monotonic
    #: What an ``https://`` data plane is verified with (None for plain ``http://``).
    tls: ssl.SSLContext | None = None


class CtrlClient:
    def __init__(self, base_url: str, credential: str, *,
                 transport: httpx.AsyncBaseTransport | None = None,
                 verify: ssl.SSLContext | None = None,
                 dataplane_verify: ssl.SSLContext | None = None) -> None:
        """`verify` checks ctrl's certificate, `dataplane_verify` the nodes' data-plane
        certificates (default for both: the system trust store)."""
        self.base_url = base_url.rstrip("/")
        self._dataplane_verify = dataplane_verify
        self._http = httpx.AsyncClient(
            base_url=self.base_url, transport=transport, follow_redirects=False,
            verify=verify or client_context(),
            headers={"Authorization": f"Bearer {credential}",
                     "User-Agent": "kibotos-gateway-e2b"})
        self._keys: dict[str, tuple[float, Team]] = {}
        self._sessions: dict[str, DataplaneSession] = {}

    async def aclose(self) -> None:
        await self._http.aclose()

    async def call(self, method: str, path: str, *, body: dict[str, Any] | None = None,
                   params: dict[str, Any] | None = None, write: bool = False,
                   timeout: float = REQUEST_TIMEOUT) -> Any:
        """``result`` of one call; `write` adds a fresh command ID."""
        if write:
            body = {**(body or {}), "command_id": new_id("gwe2b")}
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

    # ---------------------------------------------------------------- keys

    async def team_of(self, key: str | None) -> Team:
        """Whose key this is; `Unauthenticated` for none, a bad or a revoked one."""
        if not key:
            raise Unauthenticated("missing API key: send it in the X-API-Key header")
        cached = self._keys.get(key)
        if cached is not None and time.monotonic() - cached[0] < KEY_TTL:
            return cached[1]
        found = await self.call("POST", "/v1/api-keys/verify", body={"key": key})
        team = Team(str(found["key_id"]), str(found["name"]), str(found["team"]))
        if len(self._keys) > 4096:
            self._keys.clear()
        self._keys[key] = (time.monotonic(), team)
        return team

    # ---------------------------------------------------------------- workspaces

    async def create_workspace(self, body: dict[str, Any]) -> dict[str, Any]:
        return dict(await self.call("POST", "/v1/workspaces", body=body, write=True))

    async def workspace(self, workspace_id: str, *, wait_s: int | None = None
                        ) -> dict[str, Any]:
        params = None if wait_s is None else {"wait_s": wait_s}
        return dict(await self.call("GET", _path(workspace_id), params=params,
                                    timeout=REQUEST_TIMEOUT + (wait_s or 0)))

    async def workspaces(self, *, labels: dict[str, str], states: list[str],
                         page_size: int, page_token: str | None) -> dict[str, Any]:
        params: dict[str, Any] = {
            "label": ",".join(f"{k}={v}" for k, v in sorted(labels.items())),
            "state": ",".join(states), "page_size": page_size}
        if page_token:
            params["page_token"] = page_token
        return dict(await self.call("GET", "/v1/workspaces", params=params))

    async def act(self, workspace_id: str, action: str, **body: Any) -> dict[str, Any]:
        """``start``, ``stop`` (``force=True`` allowed) or ``delete``."""
        self._sessions.pop(workspace_id, None)
        return dict(await self.call("POST", _path(workspace_id, action), body=body,
                                    write=True))

    # ---------------------------------------------------------------- data plane

    async def session(self, workspace_id: str) -> DataplaneSession:
        """A data-plane URL and credential for exec and files on the Workspace."""
        cached = self._sessions.get(workspace_id)
        if cached is not None and time.monotonic() < cached.expires_at:
            return cached
        got = await self.call("POST", _path(workspace_id, "sessions"),
                              body={"operations": ["exec", "files"]})
        lifetime = _seconds_until(str(got["expires_at"]))
        url = str(got["dataplane_url"])
        tls = (self._dataplane_verify or client_context()) if url.startswith("https://") \
            else None
        made = DataplaneSession(url, str(got["credential"]),
                                time.monotonic() + max(0.0, lifetime - SESSION_MARGIN), tls)
        self._sessions[workspace_id] = made
        return made

    def forget_session(self, workspace_id: str) -> None:
        self._sessions.pop(workspace_id, None)


def _path(workspace_id: str, action: str = "") -> str:
    path = f"/v1/workspaces/{quote(workspace_id, safe='')}"
    return f"{path}/{action}" if action else path


def _seconds_until(stamp: str) -> float:
    try:
        at = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        raise Internal(f"ctrl sent a session expiry that is not a time: {stamp!r}") from None
    return (at - datetime.now(UTC)).total_seconds()

