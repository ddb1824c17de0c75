"""spec node-and-vmm-processes, "Launch records and adoption" and the Troubleshooting row
"instance guest sync pending": while an adopted Instance's guest does not answer, the
Workspace stays AVAILABLE "and the guest shows as no longer responding".  The node says
so in its ``instance_state`` frame (``guest.responding``, tests/node/test_adoption.py);
here ctrl keeps it on the Instance, ``GET /v1/workspaces/{id}`` returns it, and
``kibo workspace get`` prints it, until the node reports the guest answering again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ctrl_helpers import wait_until
from ws_helpers import open_ws_ctrl

from kibotos.cli.workspace.workspace_render import get_sections, guest_responding
from kibotos.testing.clock import ThreadAwareClock


def lines(ws: dict[str, Any], *, wide: bool = False) -> dict[str, str]:
    found: dict[str, str] = {}
    for section in get_sections(ws, {"node_id": ws["node_id"],
                                     "instance_id": ws["instance_id"]}, wide=wide):
        found.update(section.lines)
    return found


async def test_a_guest_that_does_not_answer_is_shown_until_it_does(tmp_path: Path,
        autojump_clock: ThreadAwareClock) -> None:
    async with open_ws_ctrl(tmp_path) as ctrl:
        node = await ctrl.connect("node-a")
        ws = await ctrl.settled((await ctrl.create())["workspace_id"])
        wid, iid = ws["workspace_id"], ws["instance_id"]
        assert guest_responding(await ctrl.ws(wid)) is None  # nothing said yet
        assert "Guest" not in lines(await ctrl.ws(wid))

        async def frame(responding: bool) -> None:
            await node.send({"type": "instance_state", "instance_id": iid,
                             "workspace_id": wid, "state": "RUNNING",
                             "guest": {"boot_id": "b-1", "capabilities": ["exec"],
                                       "responding": responding}})

        await frame(False)  # adopted after a node restart; the guest does not answer

        async def shown(expected: bool) -> bool:
            return guest_responding(await ctrl.ws(wid)) is expected

        await wait_until(lambda: shown(False), "the guest shown as not responding")
        now = await ctrl.ws(wid)
        assert now["state"] == "AVAILABLE"
        assert lines(now)["Guest"] == "not responding (the node keeps retrying)"
        assert lines(now, wide=True)["Guest responding"] == "no"
        await frame(True)  # recovered=true on the node
        await wait_until(lambda: shown(True), "the guest shown as responding again")
        now = await ctrl.ws(wid)
        assert "Guest" not in lines(now)
        assert lines(now, wide=True)["Guest responding"] == "yes"
        assert lines(now, wide=True)["Guest boot ID"] == "b-1"


def test_only_the_current_instances_guest_counts() -> None:
    ws = {"workspace_id": "ws-1", "state": "STOPPED", "instance_id": None,
          "node_id": None, "instance": {"instance_id": "inst-1",
                                        "guest": {"responding": False}}}
    assert guest_responding(ws) is None
    assert "Guest" not in lines(ws)
