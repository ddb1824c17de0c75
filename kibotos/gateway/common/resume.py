"""Waking a paused sandbox on traffic (E2B's ``autoResume``), for both gateways.

A kibotos pause is a stop with the writable layer kept, so a wake is a start: a new
Instance that boots from the layer (E2B's ``on_resume="reboot"``), and the request that
woke it waits until the Workspace is AVAILABLE.  Two rules make that safe under load:

* **One wake per Workspace.**  A page that opens ten connections, or an agent that
  sends three envd calls at once, makes one ``start``; every other request waits on
  the wake already under way.  A second gateway process (the Exposure gateway beside
  the E2B gateway, or another replica of either) may start it first: ctrl then
  refuses this one's ``start`` (the Workspace is no longer STOPPED) and the wake waits
  on theirs instead of failing.
* **A wake outlives its requester.**  It runs in the gateway process's nursery, not in
  the request's task, so a client that gives up (a browser tab closed, an SDK
  timeout) does not cancel the start the others wait on, nor leave a Workspace
  half-started with nobody watching.

Whether a sandbox may be woken is the caller's decision (the label
`sandbox_labels.AUTO_RESUME_LABEL`); this module only wakes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from kibotos.core.errors import Aborted, FailedPrecondition, KibotosError

log = logging.getLogger("kibotos.gateway")

#: How long a wake waits for the Workspace to be AVAILABLE (a boot under TCG is slow).
WAKE_TIMEOUT = 600.0
#: States a wake starts from (STOPPING: waited out first) or joins (a start under way).
WAKEABLE = ("STOPPING", "STOPPED", "STARTING")
#: The outcomes a wake is counted by: ``started`` (this process started it),
#: ``joined`` (another process's start was waited on), ``failed``.
OUTCOMES = ("started", "joined", "failed")


class WorkspaceReader(Protocol):
    """What a `Resumer` needs of a gateway's ctrl client (`CtrlHttp` has both)."""

    async def workspace(self, workspace_id: str, *, wait_s: int | None = None
                        ) -> dict[str, Any]: ...

    async def act(self, workspace_id: str, action: str, **body: Any) -> dict[str, Any]: ...


@dataclass
class _Wake:
    done: trio.Event = field(default_factory=trio.Event)
    workspace: dict[str, Any] | None = None
    error: KibotosError | None = None


async def wait_settled(ctrl: WorkspaceReader, ws: dict[str, Any], deadline: float
                       ) -> dict[str, Any]:
    """`ws` once it is in no transition (long-polled): AVAILABLE, or a
    `FailedPrecondition` naming the state it settled in or is still in at `deadline`."""
    while ws["state"] not in ("AVAILABLE", "STOPPED", "FAILED", "DELETED"):
        if time.monotonic() > deadline:
            raise FailedPrecondition(f"workspace {ws['workspace_id']} is still "
                                     f"{ws['state']}")
        ws = await ctrl.workspace(ws["workspace_id"], wait_s=30)
    if ws["state"] != "AVAILABLE":
        reason = f": {ws['reason']}" if ws.get("reason") else ""
        raise FailedPrecondition(f"workspace {ws['workspace_id']} is {ws['state']}{reason}")
    return ws


class Resumer:
    """Wakes paused Workspaces, one wake per Workspace at a time, each a task of
    `nursery` (the gateway process's own, which outlives every request)."""

    def __init__(self, ctrl: WorkspaceReader, nursery: trio.Nursery, *,
                 on_outcome: Callable[[str], None] = lambda outcome: None,
                 timeout: float = WAKE_TIMEOUT) -> None:
        self.ctrl = ctrl
        self._nursery = nursery
        self._on_outcome = on_outcome
        self._timeout = timeout
        self._waking: dict[str, _Wake] = {}

    async def wake(self, workspace_id: str) -> dict[str, Any]:
        """The Workspace once AVAILABLE, started if it was paused; the wake's error
        (every waiter gets the same) if it cannot be."""
        wake = self._waking.get(workspace_id)
        if wake is None:
            wake = self._waking[workspace_id] = _Wake()
            self._nursery.start_soon(self._wake, workspace_id, wake)
        await wake.done.wait()
        if wake.error is not None:
            raise wake.error
        assert wake.workspace is not None
        return wake.workspace

    async def _wake(self, workspace_id: str, wake: _Wake) -> None:
        outcome = "failed"
        try:
            wake.workspace, outcome = await self._start(workspace_id)
        except KibotosError as exc:
            log.warning("workspace %s: waking it failed: %s", workspace_id, exc.message)
            wake.error = exc
        except BaseException:
            wake.error = FailedPrecondition(f"workspace {workspace_id}: the wake was "
                                            "cancelled (the gateway is stopping)")
            raise
        finally:
            del self._waking[workspace_id]
            wake.done.set()
            self._on_outcome(outcome)

    async def _start(self, workspace_id: str) -> tuple[dict[str, Any], str]:
        deadline = time.monotonic() + self._timeout
        ws = await self.ctrl.workspace(workspace_id)
        while ws["state"] == "STOPPING":  # a pause under way: start once it is done
            if time.monotonic() > deadline:
                raise FailedPrecondition(f"workspace {workspace_id} is still STOPPING")
            ws = await self.ctrl.workspace(workspace_id, wait_s=30)
        outcome = "joined"
        if ws["state"] == "STOPPED":
            try:
                ws = await self.ctrl.act(workspace_id, "start")
                outcome = "started"
                log.info("workspace %s: woken by traffic (auto-resume)", workspace_id)
            except (FailedPrecondition, Aborted):
                ws = await self.ctrl.workspace(workspace_id)  # someone else's start
                if ws["state"] == "STOPPED":
                    raise
        return await wait_settled(self.ctrl, ws, deadline), outcome
