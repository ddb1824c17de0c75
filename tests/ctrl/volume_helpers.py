"""Helpers of the Volume tests (ctrl with simulated nodes, `ws_helpers`)."""

from __future__ import annotations

from typing import Any

import trio
from ws_helpers import GI, WsCtrl

from kibotos.testing.sim_instances import SimInstances


async def volume(ctrl: WsCtrl, volume_id: str, wait_s: float = 0.0) -> dict[str, Any]:
    return dict(await ctrl.call("GET", f"/v1/volumes/{volume_id}",
                                params={"wait_s": wait_s}))


async def settled_volume(ctrl: WsCtrl, volume_id: str) -> dict[str, Any]:
    with trio.fail_after(30):
        while True:
            got = await volume(ctrl, volume_id, wait_s=5.0)
            op = got["operation"]
            if got["state"] in ("AVAILABLE", "FAILED", "DELETED") and (
                    op is None or op["status"] == "failed"):
                return got


async def create_volume(ctrl: WsCtrl, code: str | None = None, **body: Any) -> Any:
    return await ctrl.call("POST", "/v1/volumes",
                           json={"capacity_bytes": GI, **body}, code=code)


def kinds(sim: SimInstances, kind: str) -> list[dict[str, Any]]:
    return [c["args"] for c in sim.commands if c["kind"] == kind]
