"""Who may reach a sandbox's ports, decided on ctrl's record of its Workspace, and the
data-plane credential the proxy reaches them with.

The rule (docs/gateways.md, "Who reaches a sandbox's ports"), E2B's: a sandbox's
traffic is public unless it was created with ``allow_public_traffic: false``; then
every request must carry its traffic access token (``e2b-traffic-access-token``), which
only a key of its team was given.  So another team reaches a public sandbox as anyone
on the network does, and a private one not at all without the token.  Only E2B
sandboxes are exposed (Workspaces with `TEAM_LABEL`): any other Workspace, and an ID no
Workspace has, is "not found", so the proxy tells nothing about the cluster.

A paused sandbox created with ``autoResume`` (its Workspace carries
`AUTO_RESUME_LABEL`) is woken by a request that passed the checks above: the request
waits for the boot (`kibotos.gateway.common.resume`; one wake however many requests
ask), so a refused request never starts anything.

The Workspace is read from ctrl at most every `WORKSPACE_TTL` seconds per sandbox, so
a busy page is not one ctrl call per request; a sandbox that stops is refused within
that time, and its open connections end with it in the data plane.
"""

from __future__ import annotations

import time
from typing import Any

from kibotos.core.errors import NotFound, PermissionDenied, Unavailable
from kibotos.gateway.common.ctrl_http import CtrlHttp, DataplaneSession
from kibotos.gateway.common.resume import WAKEABLE, Resumer
from kibotos.gateway.common.sandbox_labels import (
    TEAM_LABEL,
    TRAFFIC_HEADER,
    auto_resumes,
    traffic_allowed,
)
from kibotos.gateway.exposure.routing import Target

#: How long a Workspace read from ctrl is used for access decisions.
WORKSPACE_TTL = 2.0
_MAX_CACHED = 4096


class SandboxAccess:
    def __init__(self, ctrl: CtrlHttp, resumer: Resumer) -> None:
        self.ctrl = ctrl
        self.resumer = resumer
        self._workspaces: dict[str, tuple[float, dict[str, Any]]] = {}

    async def _workspace(self, target: Target) -> dict[str, Any]:
        cached = self._workspaces.get(target.sandbox_id)
        if cached is not None and time.monotonic() - cached[0] < WORKSPACE_TTL:
            return cached[1]
        try:
            ws = await self.ctrl.workspace(target.workspace_id)
        except NotFound:
            raise NotFound(f"sandbox {target.sandbox_id} not found") from None
        self._remember(target, ws)
        return ws

    def _remember(self, target: Target, ws: dict[str, Any]) -> None:
        if len(self._workspaces) >= _MAX_CACHED:
            self._workspaces.clear()
        self._workspaces[target.sandbox_id] = (time.monotonic(), ws)

    async def open(self, target: Target, traffic_token: str | None) -> DataplaneSession:
        """The session to reach `target` with; `NotFound` (no such sandbox),
        `PermissionDenied` (private, without its token) or `Unavailable` (not running,
        and not to be woken)."""
        ws = await self._workspace(target)
        labels = ws.get("labels") or {}
        if TEAM_LABEL not in labels or ws.get("state") in ("DELETING", "DELETED"):
            raise NotFound(f"sandbox {target.sandbox_id} not found")
        if not traffic_allowed(labels, traffic_token):
            raise PermissionDenied(f"sandbox {target.sandbox_id} does not allow public "
                                   f"traffic: send its traffic access token in the "
                                   f"{TRAFFIC_HEADER} header")
        if ws.get("state") != "AVAILABLE" and auto_resumes(labels) \
                and ws.get("state") in WAKEABLE:
            ws = await self.resumer.wake(target.workspace_id)
            self._remember(target, ws)
        if ws.get("state") != "AVAILABLE":
            raise Unavailable(f"sandbox {target.sandbox_id} is not running (it is "
                              f"{str(ws.get('state')).lower()})")
        return await self.ctrl.dataplane_session(target.workspace_id, ("ports",))

    def forget(self, target: Target) -> None:
        """The sandbox moved or stopped: ask ctrl again next time."""
        self._workspaces.pop(target.sandbox_id, None)
        self.ctrl.forget_session(target.workspace_id)
