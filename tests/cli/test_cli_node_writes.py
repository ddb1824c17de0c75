"""drain (and --wait), cancel-drain, isolate, retire and overcommit against the fake ctrl."""

from __future__ import annotations

import json

import pytest
from cli_nodes import node

from kibotos.cli.cluster import node_cmds
from kibotos.cli.core import output

DRAIN = "/v1/nodes/node-a/drain"
GET = "/v1/nodes/node-a"


def draining(instances=1, volumes=0, **changes):
    n = node(**{"status": "DRAINING", "drain_requested": True, **changes})
    n["latest_report"].update(instance_count=instances, volume_count=volumes)
    return n


def drained(**changes):
    return draining(0, 0, status="DRAINED", **changes)


def wait(kibo, *extra):
    return kibo("node", "drain", "node-a", "--wait", "--poll-interval", "0.01", *extra)


def test_drain_prints_summary(kibo, fake_ctrl):
    fake_ctrl.route("POST", DRAIN, (200, {"result": draining()}))
    result = kibo("node", "drain", "node-a", "--expected-version", "7")
    assert result.exit_code == 0
    assert result.stdout == ("drain requested for node node-a: status DRAINING, "
                             "registration version 7\n")
    assert fake_ctrl.sent("POST")[0].body["expected_version"] == 7


def test_drain_wait_reaches_drained(kibo, fake_ctrl):
    fake_ctrl.route("POST", DRAIN, (200, {"result": draining(2, 1)}))
    fake_ctrl.route("GET", GET, (200, {"result": draining(1, 1)}),
                    (200, {"result": draining(0, 1)}), (200, {"result": drained()}))
    result = wait(kibo, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["result"]["status"] == "DRAINED"
    assert "waiting for node node-a to drain (2 instance(s), 1 volume(s))" in result.stderr
    assert len(fake_ctrl.sent("POST")) == 1
    assert len(fake_ctrl.sent("GET")) == 3


def test_drain_wait_on_an_empty_node_returns_at_once(kibo, fake_ctrl):
    fake_ctrl.route("POST", DRAIN, (200, {"result": drained()}))
    result = wait(kibo)
    assert result.exit_code == 0
    assert fake_ctrl.sent("GET") == []


def test_drain_wait_timeout_is_16_and_not_resubmitted(kibo, fake_ctrl):
    fake_ctrl.route("POST", DRAIN, (200, {"result": draining()}))
    fake_ctrl.route("GET", GET, (200, {"result": draining()}))
    result = wait(kibo, "--timeout", "300ms")
    assert result.exit_code == 16
    assert "did not reach DRAINED within the global --timeout of 0.3s" in result.stderr
    assert "1 instance(s)" in result.stderr
    assert "the drain stays requested and kibo does not submit it again" in result.stderr
    assert len(fake_ctrl.sent("POST")) == 1
    assert all(r.method == "GET" for r in fake_ctrl.requests[1:])


@pytest.mark.parametrize(("after", "needle"), [
    (node(status="READY", drain_requested=False), "was cancelled"),
    (node(status="REVOKED", admission="revoked", drain_requested=True), "was revoked"),
    (node(status="RETIRED", retired=True, drain_requested=True), "was retired"),
])
def test_drain_wait_ends_13_when_cancelled_revoked_or_retired(kibo, fake_ctrl, after, needle):
    fake_ctrl.route("POST", DRAIN, (200, {"result": draining()}))
    fake_ctrl.route("GET", GET, (200, {"result": draining()}), (200, {"result": after}))
    result = wait(kibo)
    assert result.exit_code == 13
    assert needle in result.stderr
    assert result.stderr.splitlines()[-1].startswith("error: failed_precondition:")


def test_drain_wait_rides_out_an_unavailable_ctrl(kibo, fake_ctrl):
    fake_ctrl.route("POST", DRAIN, (200, {"result": draining()}))
    down = (503, {"error": {"code": "unavailable", "message": "store unavailable"}})
    fake_ctrl.route("GET", GET, down, down, (200, {"result": drained()}))
    result = wait(kibo)
    assert result.exit_code == 0, result.stderr
    assert result.stderr.count("store unavailable; still waiting") == 1


def test_drain_poll_interval_is_fixed_by_default():
    assert node_cmds.DRAIN_POLL_INTERVAL == 2.0


def test_cancel_drain(kibo, fake_ctrl):
    fake_ctrl.route("POST", "/v1/nodes/node-a/cancel-drain",
                    (200, {"result": node(registration_version=9)}))
    result = kibo("node", "cancel-drain", "node-a", "--command-id", "cd-1")
    assert result.exit_code == 0
    assert result.stdout == ("drain cancelled for node node-a: status READY, "
                             "registration version 9\n")
    assert fake_ctrl.sent()[0].body == {"command_id": "cd-1"}


def test_isolate_prints_released_counts(kibo, fake_ctrl):
    answer = {"node": node(status="ISOLATED", isolated=True), "released_volumes": 3,
              "released_retained_layers": 1, "failed_workspaces": 2}
    fake_ctrl.route("POST", "/v1/nodes/node-a/isolate", (200, {"result": answer}))
    result = kibo("node", "isolate", "node-a", "--confirm-host-cannot-write",
                  "--command-id", "isolate-a", "--expected-version", "7")
    assert result.exit_code == 0
    assert result.stdout == ("isolated node node-a: released 3 volume(s) and 1 retained "
                             "layer(s); 2 workspace(s) moved to FAILED\n")
    assert fake_ctrl.sent()[0].body == {"confirm_host_cannot_write": True,
                                        "command_id": "isolate-a", "expected_version": 7}
    as_json = kibo("node", "isolate", "node-a", "--confirm-host-cannot-write", "--json")
    assert json.loads(as_json.stdout) == {"result": answer}


def test_isolate_refused_while_alive_is_13(kibo, fake_ctrl):
    fake_ctrl.route("POST", "/v1/nodes/node-a/isolate", (412, {"error": {
        "code": "failed_precondition", "message": "node node-a has a live control session"}}))
    result = kibo("node", "isolate", "node-a", "--confirm-host-cannot-write")
    assert result.exit_code == 13


def test_retire_with_yes(kibo, fake_ctrl):
    fake_ctrl.route("POST", "/v1/nodes/node-a/retire",
                    (200, {"result": node(status="RETIRED", retired=True)}))
    result = kibo("node", "retire", "node-a", "--yes", "--command-id", "r-1",
                  "--expected-version", "7")
    assert result.exit_code == 0
    assert result.stdout.startswith("retired node node-a: status RETIRED")
    assert fake_ctrl.sent()[0].body == {"command_id": "r-1", "expected_version": 7}


@pytest.mark.parametrize(("answer", "code", "sent"), [("y\n", 0, 1), ("n\n", 1, 0),
                                                      ("\n", 1, 0)])
def test_retire_asks_on_a_terminal(kibo, fake_ctrl, monkeypatch, answer, code, sent):
    monkeypatch.setattr(output, "stdin_is_terminal", lambda: True)
    fake_ctrl.route("POST", "/v1/nodes/node-a/retire",
                    (200, {"result": node(status="RETIRED", retired=True)}))
    result = kibo("node", "retire", "node-a", input=answer)
    assert result.exit_code == code
    assert "Retirement is final" in result.stderr
    assert len(fake_ctrl.requests) == sent


# ------------------------------------------------------------------------ overcommit

OVERCOMMIT = {"default": {"cpu": "4", "memory": "1"}, "version": 3,
              "overrides": [{"node_id": "node-a", "cpu": "2.5", "memory": None,
                             "registration_version": 7}]}


def test_overcommit_get(kibo, fake_ctrl):
    fake_ctrl.route("GET", "/v1/overcommit", (200, {"result": OVERCOMMIT}))
    result = kibo("node", "overcommit", "get")
    assert result.exit_code == 0
    assert "  CPU:     4\n  Memory:  1\n  Version: 3\n" in result.stdout
    assert "| node-a | 2.5 | default | 7           |" in result.stdout
    assert json.loads(kibo("node", "overcommit", "get", "--json").stdout) == {
        "result": OVERCOMMIT}


def test_overcommit_set_default_sends_canonical_ratios(kibo, fake_ctrl):
    fake_ctrl.route("PUT", "/v1/overcommit/default", (200, {"result": OVERCOMMIT}))
    result = kibo("node", "overcommit", "set-default", "--cpu", "4.000")
    assert result.exit_code == 0
    body = fake_ctrl.sent()[0].body
    assert body["cpu"] == "4"
    assert "memory" not in body
    assert body["command_id"].startswith("kibo-")


@pytest.mark.parametrize(("args", "expected"), [
    (["--cpu", "2.50", "--memory", "0.9"], {"cpu": "2.5", "memory": "0.9"}),
    (["--cpu", "default"], {"cpu": "default"}),
    (["--memory", "16"], {"memory": "16"}),
    (["--cpu", "0", "--memory", "0.125"], {"cpu": "0", "memory": "0.125"}),
])
def test_overcommit_set(kibo, fake_ctrl, args, expected):
    fake_ctrl.route("PUT", "/v1/nodes/node-a/overcommit", (200, {"result": node()}))
    result = kibo("node", "overcommit", "set", "node-a", *args)
    assert result.exit_code == 0, result.stderr
    body = fake_ctrl.sent()[0].body
    body.pop("command_id")
    assert body == expected
    assert result.stdout == ("node node-a: overcommit CPU 2.5 (override), memory 1 "
                             "(default), registration version 7\n")


def test_overcommit_set_with_command_id_sends_everything(kibo, fake_ctrl):
    fake_ctrl.route("PUT", "/v1/nodes/node-a/overcommit", (200, {"result": node()}))
    result = kibo("node", "overcommit", "set", "node-a", "--cpu", "2", "--memory", "default",
                  "--command-id", "oc-1", "--expected-version", "7")
    assert result.exit_code == 0
    assert fake_ctrl.sent()[0].body == {"cpu": "2", "memory": "default",
                                        "command_id": "oc-1", "expected_version": 7}
