"""The E2B gateway's client of ctrl's HTTP API: keys, Workspaces, data-plane sessions
(the calls themselves, errors and session caching: `kibotos.gateway.common.ctrl_http`).

Verified keys are cached for `KEY_TTL` (a revoke takes effect within it), so the
common path is one ctrl call or none.
"""

from __future__ import annotations

import ssl
import time
from dataclasses import dataclass
from typing import Any

import httpx

from kibotos.core.errors import Unauthenticated
from kibotos.gateway.common.ctrl_http import CtrlHttp, DataplaneSession

__all__ = ["KEY_TTL", "CtrlClient", "DataplaneSession", "Team"]

#: How long a verified key is trusted without asking ctrl again.
KEY_TTL = 5.0


@dataclass(frozen=True)
class Team:
    """Who presented a key: the key and the team it belongs to."""

    key_id: str
    name: str
    team: str


class CtrlClient(CtrlHttp):
    def __init__(self, base_url: str, credential: str, *,
                 transport: httpx.AsyncBaseTransport | None = None,
                 verify: ssl.SSLContext | None = None,
                 dataplane_verify: ssl.SSLContext | None = None) -> None:
        """`verify` checks ctrl's certificate, `dataplane_verify` the nodes' data-plane
        certificates (default for both: the system trust store)."""
        super().__init__(base_url, credential, user_agent="kibotos-gateway-e2b",
                         command_prefix="gwe2b", transport=transport, verify=verify,
                         dataplane_verify=dataplane_verify)
        self._keys: dict[str, tuple[float, Team]] = {}

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

    async def workspaces(self, *, labels: dict[str, str], states: list[str],
                         page_size: int, page_token: str | None) -> dict[str, Any]:
        params: dict[str, Any] = {
            "label": ",".join(f"{k}={v}" for k, v in sorted(labels.items())),
            "state": ",".join(states), "page_size": page_size}
        if page_token:
            params["page_token"] = page_token
        return dict(await self.call("GET", "/v1/workspaces", params=params))

    # ---------------------------------------------------------------- egresses

    async def create_egress(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/egresses``; `body` holds the password, which ctrl seals."""
        return dict(await self.call("POST", "/v1/egresses", body=body, write=True))

    async def delete_egress(self, name: str) -> None:
        await self.call("DELETE", f"/v1/egresses/{name}", body={}, write=True)

    # ---------------------------------------------------------------- data plane

    async def session(self, workspace_id: str) -> DataplaneSession:
        """A data-plane URL and credential for exec and files on the Workspace."""
        return await self.dataplane_session(workspace_id, ("exec", "files"))
