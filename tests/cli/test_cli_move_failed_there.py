"""`kibo workspace move` to the node a FAILED Workspace is still on (its Instance holds
resources until ``stop --force``): not "already runs there" — the move goes on to its
start, and ctrl's refusal tells the operator to force the stop first.  Against the
recording fake ctrl, which answers as a ctrl from before move-check looked at the state
(``already_there`` from the node alone)."""

from __future__ import annotations

from typing import Any

WS = "ws-01k6dddddddddddddddddddddd"
INST = "inst-01k6eeeeeeeeeeeeeeeeeeeeee"


def failed_on_b() -> dict[str, Any]:
    return {"workspace_id": WS, "state": "FAILED",
            "reason": "node reports the Instance as no longer running", "revision": 7,
            "node_id": "node-b", "instance_id": INST, "labels": {},
            "template": {"name": "base"}, "resources": {"cpu_millis": 1000,
                                                        "memory_bytes": 1 << 30}}


def test_a_failed_workspace_is_not_already_there(kibo, fake_ctrl):
    fake_ctrl.route("GET", f"/v1/workspaces/{WS}/move-check", (200, {"result": {
        "workspace": failed_on_b(), "node_id": "node-b", "already_there": True,
        "objects": [], "node_pools": ["shared-1"]}}))
    refusal = (f"workspace {WS} is FAILED and its Instance still holds resources on "
               f"node node-b: run `kibo workspace stop {WS} --force` first")
    fake_ctrl.route("POST", f"/v1/workspaces/{WS}/start", (412, {"error": {
        "code": "failed_precondition", "message": refusal}}))
    result = kibo("workspace", "move", WS, "--node", "node-b", "--command-id", "mv-f")
    assert result.exit_code == 13, result.stdout
    assert "already runs" not in result.stdout
    assert f"kibo workspace stop {WS} --force" in result.stderr
    # FAILED: no stop; the start is the one the move would make.
    assert [(p.path.rsplit("/", 1)[1], p.body) for p in fake_ctrl.sent("POST")] == [
        ("start", {"node_id": "node-b", "command_id": "mv-f/start"})]
