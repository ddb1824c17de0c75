"""E2B's ``autoResume`` through the official SDK and both gateways, on the shared test
cluster (test VMM: the real node, data plane and guest agent): traffic wakes a paused
sandbox created with ``auto_resume`` (envd calls through the E2B gateway, requests
through the Exposure gateway after the traffic-token check), three calls at once make
one start, the sandbox gets a fresh lifetime, and a sandbox without ``auto_resume``
stays paused.  (A wake is a ctrl start, as a connect is: that the writable layer is
kept across it needs a real disk, test_e2b_sdk_qemu.py's.)  E2B's own rules on the
option are kept."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from e2b import Sandbox, SandboxException
from gateway_proc import E2bSetup

from kibotos.testing.waiting import wait_until_sync

pytestmark = pytest.mark.slow

AUTO = {"on_timeout": "pause", "auto_resume": True}


def _state(e2b: E2bSetup, sbx: Sandbox) -> str:
    return str(e2b.cluster.api("GET", f"/v1/workspaces/ws-{sbx.sandbox_id}")["state"])


def _pause(e2b: E2bSetup, sbx: Sandbox) -> None:
    sbx.pause(mode="filesystem")
    wait_until_sync(lambda: _state(e2b, sbx) == "STOPPED", "the sandbox is paused",
                    timeout=120.0, interval=0.5)


def _counted(text: str, name: str, outcome: str) -> float:
    m = re.search(rf'^{name}_total{{outcome="{outcome}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _e2b_resumes(e2b: E2bSetup, outcome: str) -> float:
    text = httpx.get(f"{e2b.gateway.api_url}/metrics").text
    return _counted(text, "kibotos_gateway_e2b_sandbox_resumes", outcome)


def test_envd_calls_wake_a_paused_auto_resume_sandbox_once(e2b: E2bSetup) -> None:
    sbx = Sandbox.create("base", timeout=600, lifecycle=AUTO, **e2b.opts())
    try:
        info = sbx.get_info()
        assert info.lifecycle == {"on_timeout": "pause", "auto_resume": True}
        ws = e2b.cluster.api("GET", f"/v1/workspaces/ws-{sbx.sandbox_id}")
        assert ws["labels"]["e2b.auto-resume"] == "true"
        _pause(e2b, sbx)
        assert sbx.get_info().state.value == "paused"
        started = _e2b_resumes(e2b, "started")

        with ThreadPoolExecutor(3) as pool:
            runs = list(pool.map(lambda i: sbx.commands.run(f"echo woken {i}").stdout,
                                 range(3)))
        assert runs == [f"woken {i}\n" for i in range(3)]
        assert _e2b_resumes(e2b, "started") == started + 1  # three calls, one start
        assert _state(e2b, sbx) == "AVAILABLE"
        # the pause stopped its lifetime; the wake gave it the one it was created with
        end_at = sbx.get_info().end_at.timestamp()
        assert time.time() + 500 < end_at < time.time() + 601
    finally:
        sbx.kill()


def test_a_sandbox_without_auto_resume_stays_paused(e2b: E2bSetup) -> None:
    sbx = Sandbox.create("base", timeout=600, lifecycle={"on_timeout": "pause"},
                         **e2b.opts())
    try:
        assert sbx.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": False}
        _pause(e2b, sbx)
        with pytest.raises(SandboxException, match="STOPPED"):
            sbx.commands.run("echo never")
        assert _state(e2b, sbx) == "STOPPED"
        assert Sandbox.connect(sbx.sandbox_id, **e2b.opts()).commands.run(
            "echo connected").stdout == "connected\n"
    finally:
        sbx.kill()


def test_e2b_rules_on_auto_resume_are_kept(e2b: E2bSetup) -> None:
    """What the SDK checks before it sends, checked again for any other client."""
    url, headers = f"{e2b.gateway.api_url}/v2/sandboxes", {"X-API-Key": e2b.key}
    cases = {
        "autoResume needs autoPause": {"autoResume": {"enabled": True}},
        "autoPauseMemory false": {"autoResume": {"enabled": True}, "autoPause": True,
                                  "autoPauseMemory": False},
    }
    for message, body in cases.items():
        answer = httpx.post(url, headers=headers,
                            json={"templateID": "base", **body}, timeout=60)
        assert answer.status_code == 400, answer.text
        assert message in answer.json()["message"]
    listed = httpx.get(url, headers=headers, timeout=60).json()
    assert not any(s["lifecycle"]["autoResume"] for s in listed)  # nothing was made


def test_exposure_requests_wake_after_the_traffic_token_check(e2b: E2bSetup) -> None:
    sbx = Sandbox.create("base", timeout=600, lifecycle=AUTO,
                         network={"allow_public_traffic": False}, **e2b.opts())
    try:
        token = sbx.traffic_access_token
        assert isinstance(token, str)
        _pause(e2b, sbx)
        address = (e2b.cluster.dir / "gateway-exposure/state/metrics-listen-address")
        metrics = f"http://{address.read_text().strip()}/metrics"
        name = "kibotos_gateway_exposure_sandbox_resumes"
        started = _counted(httpx.get(metrics).text, name, "started")

        def get(**headers: str) -> httpx.Response:
            return httpx.get(f"{e2b.gateway.exposure_url}/", timeout=120,
                             headers={"Host": sbx.get_host(8000), **headers})

        assert get().status_code == 403  # refused before anything is started
        assert _state(e2b, sbx) == "STOPPED"
        answer = get(**{"e2b-traffic-access-token": token})
        # woken: the Workspace runs again; a cold boot started no server on the port
        assert answer.status_code == 502, answer.text
        assert "8000" in answer.text
        assert _state(e2b, sbx) == "AVAILABLE"
        assert _counted(httpx.get(metrics).text, name, "started") == started + 1
        # the E2B gateway, which keeps the lifetimes, sees the wake and renews it
        wait_until_sync(lambda: sbx.get_info().end_at.timestamp() < time.time() + 601,
                        "the woken sandbox has a lifetime again", timeout=30.0,
                        interval=0.5)
        assert sbx.get_info().end_at.timestamp() > time.time() + 500
    finally:
        sbx.kill()
