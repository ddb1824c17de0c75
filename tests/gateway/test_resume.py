"""The `Resumer`'s rules, against a ctrl stand-in that keeps a Workspace's state as
ctrl does (a start refused unless STOPPED, a long poll that answers on a change): one
wake however many ask, a wake that outlives a requester who gives up, another
process's start waited on, and one error for every waiter.  The real ctrl and both
gateways are in test_e2b_sdk.py and test_exposure.py."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from kibotos.core.errors import FailedPrecondition
from kibotos.gateway.common.resume import Resumer

WS = "ws-" + "a" * 26


class Ctrl:
    """A Workspace's state machine: STOPPED → start → STARTING → (boot) → AVAILABLE."""

    def __init__(self, state: str, boot_s: float = 5.0, fail_boot: bool = False) -> None:
        self.state = state
        self.boot_s = boot_s
        self.fail_boot = fail_boot
        self.starts = 0
        self.changed = trio.Event()
        self.nursery: trio.Nursery | None = None

    def _set(self, state: str) -> None:
        self.state = state
        self.changed.set()
        self.changed = trio.Event()

    def _ws(self) -> dict[str, Any]:
        return {"workspace_id": WS, "state": self.state,
                "reason": "boot failed" if self.state == "FAILED" else None}

    async def workspace(self, workspace_id: str, *, wait_s: int | None = None
                        ) -> dict[str, Any]:
        assert workspace_id == WS
        if wait_s:
            with trio.move_on_after(wait_s):
                await self.changed.wait()
        return self._ws()

    async def act(self, workspace_id: str, action: str, **body: Any) -> dict[str, Any]:
        assert (workspace_id, action) == (WS, "start")
        if self.state != "STOPPED":
            raise FailedPrecondition(f"workspace {WS} is {self.state}, not STOPPED")
        self.starts += 1
        self._set("STARTING")
        assert self.nursery is not None
        self.nursery.start_soon(self._boot)
        return self._ws()

    async def _boot(self) -> None:
        await trio.sleep(self.boot_s)
        self._set("FAILED" if self.fail_boot else "AVAILABLE")

    def start_elsewhere(self) -> None:
        """Another gateway process's start."""
        self.starts += 1
        self._set("STARTING")
        assert self.nursery is not None
        self.nursery.start_soon(self._boot)


async def _with_resumer(ctrl: Ctrl, body: Any) -> tuple[Resumer, list[str]]:
    outcomes: list[str] = []
    async with trio.open_nursery() as nursery:
        ctrl.nursery = nursery
        resumer = Resumer(ctrl, nursery, on_outcome=outcomes.append)
        await body(resumer)
        nursery.cancel_scope.cancel()
    return resumer, outcomes


async def test_concurrent_wakes_make_one_start(autojump_clock: Any) -> None:
    ctrl = Ctrl("STOPPED")
    got: list[str] = []

    async def body(resumer: Resumer) -> None:
        async def one() -> None:
            got.append((await resumer.wake(WS))["state"])

        async with trio.open_nursery() as callers:
            for _ in range(3):
                callers.start_soon(one)

    _, outcomes = await _with_resumer(ctrl, body)
    assert got == ["AVAILABLE"] * 3
    assert ctrl.starts == 1
    assert outcomes == ["started"]


async def test_a_requester_giving_up_does_not_cancel_the_wake(autojump_clock: Any) -> None:
    ctrl = Ctrl("STOPPED", boot_s=10.0)

    async def body(resumer: Resumer) -> None:
        with trio.move_on_after(1.0):  # a client that gives up mid-boot
            await resumer.wake(WS)
        assert ctrl.state == "STARTING"
        assert (await resumer.wake(WS))["state"] == "AVAILABLE"  # the same wake, joined

    _, outcomes = await _with_resumer(ctrl, body)
    assert ctrl.starts == 1
    assert outcomes == ["started"]


async def test_a_start_made_by_another_process_is_waited_on(autojump_clock: Any) -> None:
    ctrl = Ctrl("STOPPED")

    async def body(resumer: Resumer) -> None:
        ctrl.start_elsewhere()
        assert (await resumer.wake(WS))["state"] == "AVAILABLE"

    _, outcomes = await _with_resumer(ctrl, body)
    assert ctrl.starts == 1
    assert outcomes == ["joined"]


async def test_a_pause_under_way_is_waited_out_then_started(autojump_clock: Any) -> None:
    ctrl = Ctrl("STOPPING")

    async def body(resumer: Resumer) -> None:
        async def stopped_later() -> None:
            await trio.sleep(3.0)
            ctrl._set("STOPPED")

        async with trio.open_nursery() as n:
            n.start_soon(stopped_later)
            assert (await resumer.wake(WS))["state"] == "AVAILABLE"

    _, outcomes = await _with_resumer(ctrl, body)
    assert ctrl.starts == 1
    assert outcomes == ["started"]


async def test_a_failed_boot_is_every_waiters_error_and_the_next_wake_is_new(
        autojump_clock: Any) -> None:
    ctrl = Ctrl("STOPPED", fail_boot=True)
    errors: list[str] = []

    async def body(resumer: Resumer) -> None:
        async def one() -> None:
            with pytest.raises(FailedPrecondition) as caught:
                await resumer.wake(WS)
            errors.append(caught.value.message)

        async with trio.open_nursery() as callers:
            callers.start_soon(one)
            callers.start_soon(one)
        assert errors == [f"workspace {WS} is FAILED: boot failed"] * 2
        ctrl.fail_boot = False
        ctrl._set("STOPPED")
        assert (await resumer.wake(WS))["state"] == "AVAILABLE"

    _, outcomes = await _with_resumer(ctrl, body)
    assert outcomes == ["failed", "started"]
    assert ctrl.starts == 2
