"""``kibo workspace cleanup-status`` of a release stuck on the node: since when it is
pending and which parts are still held, after the items table."""

from __future__ import annotations

from typing import Any

WS = "ws-01k6aaaaaaaaaaaaaaaaaaaaaa"
INST = "inst-01k6bbbbbbbbbbbbbbbbbbbbbb"


def ok(value: Any) -> tuple[int, Any]:
    return 200, {"result": value}


def test_a_pending_release_shows_since_when_and_what_is_held(kibo, fake_ctrl) -> None:
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}/cleanup-status", ok({
        "workspace_id": WS, "instance_id": INST, "node_id": "node-a",
        "items": [{"item": "RUNTIME", "status": "PENDING", "source": "node",
                   "observed_at": "2026-11-29T15:01:00.000Z"}],
        "pending_since": "2026-11-29T15:00:00.000Z",
        "held": [{"item": "RUNTIME", "part": "processes 42 survived SIGKILL"},
                 {"item": "VOLUME_ATTACHMENT", "part": "writable layer lay-1 of pool p"}]}))
    out = kibo("workspace", "cleanup-status", WS).stdout
    assert "PENDING" in out
    tail = out[out.index("release pending"):].splitlines()
    assert tail == ["release pending since 2026-11-29T15:00:00.000Z; still held:",
                    "  RUNTIME: processes 42 survived SIGKILL",
                    "  VOLUME_ATTACHMENT: writable layer lay-1 of pool p"]


def test_nothing_pending_prints_no_pending_line(kibo, fake_ctrl) -> None:
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}/cleanup-status", ok({
        "workspace_id": WS, "instance_id": INST, "node_id": "node-a", "items": [],
        "pending_since": None, "held": []}))
    assert "pending" not in kibo("workspace", "cleanup-status", WS).stdout
