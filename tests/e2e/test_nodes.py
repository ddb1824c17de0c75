"""spec/nodes.txt, walked end to end (list, get, drain, isolate, retire): the real `kibo`
against ctrl and 3 node processes.

Each test gets its own dev cluster (tests/e2e/conftest.py): 3 nodes with 4 cores and
8 GiB each, a 2 s reconcile interval, a 5 s session timeout, and the test inputs (clock
skew file, prepared proc tree).  Exit codes are the spec's (12 not found, 13 failed
precondition, 16 timed out) and docs/cli.md's (2 usage, 10 invalid argument,
14 aborted / reused command ID).

Not here yet: `drain --wait --timeout` ending with 16 while a node still reports an
Instance — it needs a node that runs one, which comes with Workspaces.
"""

from __future__ import annotations

import signal

import pytest

from kibotos.dev import DevCluster

pytestmark = pytest.mark.slow

GiB = 2**30


def version(c: DevCluster, node_id: str) -> int:
    return int(c.node(node_id)["registration_version"])


# ---------------------------------------------------------------------------- list, get


def test_list_and_get_fields_and_columns(dev_cluster, kibo_json, kibo_table):
    c = dev_cluster
    nodes = kibo_json(c, "node", "list")["result"]["nodes"]
    assert [n["node_id"] for n in nodes] == ["node-1", "node-2", "node-3"]
    for n in nodes:
        assert n["admission"] == "admitted"
        assert n["drain_requested"] is False
        assert n["isolated"] is False
        assert n["retired"] is False
        assert n["status"] == "READY"
        assert isinstance(n["registration_version"], int)
        s = n["latest_session"]
        assert s["alive"] is True
        assert isinstance(s["incarnation"], int)
        assert s["session_id"]
        assert s["release_version"]
        assert "source_revision" in s
        r = n["latest_report"]
        assert r["instance_count"] == 0
        assert r["volume_count"] == 0
        assert r["allocated"] == {"cpu_millis": 0, "memory_bytes": 0}
        assert n["resources"] == {"cpu_millis": 4000, "memory_bytes": 8 * GiB}
        assert n["overcommit"]["cpu"]["source"] == "default"
        assert n["overcommit"]["memory"]["source"] == "default"
        assert n["memory_tight"] is False
        assert n["placement"] == {"eligible": True, "reason": None}
        assert "host_usage" not in n  # shown only by get

    # Paging is the server's: two pages of 2 and 1, in node_id order.
    page = kibo_json(c, "node", "list", "--page-size", "2")["result"]
    assert [n["node_id"] for n in page["nodes"]] == ["node-1", "node-2"]
    assert page["next_page_token"]
    rest = kibo_json(c, "node", "list", "--page-size", "2", "--page-token",
                     page["next_page_token"])["result"]
    assert [n["node_id"] for n in rest["nodes"]] == ["node-3"]
    assert not rest["next_page_token"]

    # The human table: the spec's columns, REG_VERSION only with --wide.
    listing = c.kibo("node", "list")
    assert listing.returncode == 0, listing.stderr
    rows = kibo_table(listing.stdout)
    assert list(rows) == ["node-1", "node-2", "node-3"]
    assert list(rows["node-1"]) == ["NODE", "STATUS", "RELEASE", "CLOCK", "INSTANCES",
                                    "CPU_ALLOC/SCHED", "MEM_ALLOC/SCHED", "MEM_TIGHT"]
    row = rows["node-1"]
    assert row["STATUS"] == "READY"
    assert row["INSTANCES"] == "0"
    assert row["CPU_ALLOC/SCHED"] == "0/4"
    assert row["MEM_ALLOC/SCHED"] == "0B/8.0GiB"
    assert row["MEM_TIGHT"] == "no"
    assert row["RELEASE"] == "unreleased" or row["RELEASE"][0].isdigit()
    assert row["CLOCK"].endswith("ms") or row["CLOCK"].endswith("s")
    wide = kibo_table(c.kibo("node", "list", "--wide").stdout)
    assert wide["node-1"]["REG_VERSION"] == str(nodes[0]["registration_version"])

    got = kibo_json(c, "node", "get", "node-2")["result"]
    assert got["node_id"] == "node-2"
    assert "host_usage" in got
    usage = got["host_usage"]
    if usage is not None:
        # Read from the prepared proc tree: real figures, never 0 for unknown.
        assert usage["memory_total_bytes"] > 0
        assert usage["memory_tight"] is False
    human = c.kibo("node", "get", "node-2")
    assert human.returncode == 0, human.stderr
    assert "node-2" in human.stdout
    assert "READY" in human.stdout
    wide_get = c.kibo("node", "get", "node-2", "--wide")
    assert str(got["latest_session"]["session_id"]) in wide_get.stdout
    assert str(got["latest_session"]["session_id"]) not in human.stdout

    # Unknown node: 12; an ID outside the documented shape: 10, nothing sent.
    assert kibo_json(c, "node", "get", "node-9", code=12)["error"]["code"] == "not_found"
    assert c.kibo("node", "get", "Bad_Node").returncode == 10
    assert c.kibo("node", "list", "--page-size", "0").returncode == 2
    assert c.kibo("node", "list", "--no-such-flag").returncode == 2


# ---------------------------------------------------------------------------- drain


def test_drain_revisions_replay_and_wait(dev_cluster, kibo_json):
    c = dev_cluster
    v = version(c, "node-1")

    # A stale expected revision is refused and changes nothing.
    err = kibo_json(c, "node", "drain", "node-1", "--expected-version", str(v - 1),
                    code=14)["error"]
    assert err["code"] == "aborted"
    after = c.node("node-1")
    assert after["drain_requested"] is False
    assert after["registration_version"] == v

    # Accepted; an empty node is DRAINED at once.
    first = kibo_json(c, "node", "drain", "node-1", "--command-id", "drain-a",
                      "--expected-version", str(v))["result"]
    assert first["drain_requested"] is True
    assert first["status"] == "DRAINED"
    assert first["placement"] == {"eligible": False, "reason": "drain requested"}
    assert first["registration_version"] > v

    # The replay returns the stored result, even though the version has moved on.
    replay = kibo_json(c, "node", "drain", "node-1", "--command-id", "drain-a",
                       "--expected-version", str(v))["result"]
    assert replay == first
    # The same command ID with other input is refused.
    other = kibo_json(c, "node", "drain", "node-2", "--command-id", "drain-a",
                      "--expected-version", str(v), code=14)["error"]
    assert other["code"] == "already_exists"
    assert c.node("node-2")["drain_requested"] is False

    # --wait on an empty node: DRAINED, exit 0.
    waited = kibo_json(c, "node", "drain", "node-2", "--wait", "--timeout", "60s")["result"]
    assert waited["status"] == "DRAINED"

    # cancel-drain restores placement: READY again.
    cancelled = kibo_json(c, "node", "cancel-drain", "node-1")["result"]
    assert cancelled["drain_requested"] is False
    assert cancelled["status"] == "READY"
    assert cancelled["placement"]["eligible"] is True
    assert kibo_json(c, "node", "drain", "node-9", code=12)["error"]["code"] == "not_found"


# ---------------------------------------------------------------------------- isolate


def test_isolate_kill_and_new_incarnation(dev_cluster, kibo_json, wait_until):
    c = dev_cluster
    # Refused while the node's control session lives.
    err = kibo_json(c, "node", "isolate", "node-1", "--confirm-host-cannot-write",
                    code=13)["error"]
    assert err["code"] == "failed_precondition"
    assert c.node("node-1")["isolated"] is False
    # The confirmation flag is required.
    assert c.kibo("node", "isolate", "node-1").returncode == 2

    old = c.node("node-1")["latest_session"]["incarnation"]
    c.kill_node("node-1", signal.SIGKILL)
    c.wait_status(["node-1"], "OFFLINE")
    v = version(c, "node-1")
    result = kibo_json(c, "node", "isolate", "node-1", "--confirm-host-cannot-write",
                       "--command-id", "iso-1", "--expected-version", str(v))["result"]
    assert result["node"]["isolated"] is True
    assert result["node"]["status"] == "ISOLATED"
    for key in ("released_volumes", "released_retained_layers", "failed_workspaces"):
        assert key in result

    # A restart is a new incarnation: the isolate clears by itself.
    c.start_node("node-1")
    c.wait_ready(["node-1"])
    back = c.node("node-1")
    assert back["isolated"] is False
    assert back["latest_session"]["incarnation"] > old


def test_old_incarnation_is_refused_after_isolate(dev_cluster, kibo_json):
    """A node cut off (stopped, not dead) comes back with the incarnation that was
    isolated: ctrl rejects it, and the node destroys its Instances and exits 75."""
    c = dev_cluster
    old = c.node("node-2")["latest_session"]["incarnation"]
    c.kill_node("node-2", signal.SIGSTOP)
    c.wait_status(["node-2"], "OFFLINE")  # the session timeout (5 s) ends the session
    kibo_json(c, "node", "isolate", "node-2", "--confirm-host-cannot-write")
    c.kill_node("node-2", signal.SIGCONT)
    assert c.wait_node_exit("node-2") == 75
    rec = c.node("node-2")
    assert rec["status"] == "ISOLATED"
    assert rec["latest_session"]["incarnation"] == old
    assert rec["latest_session"]["alive"] is False

    c.start_node("node-2")  # what systemd does after exit 75
    c.wait_ready(["node-2"])
    assert c.node("node-2")["isolated"] is False


# ---------------------------------------------------------------------------- retire


def test_retire_only_from_drained_or_isolated_and_final(dev_cluster, kibo_json, wait_until):
    c = dev_cluster
    err = kibo_json(c, "node", "retire", "node-3", "--yes", code=13)["error"]
    assert err["code"] == "failed_precondition"
    assert c.node("node-3")["retired"] is False
    # No terminal and no --yes: refused before anything is sent.
    assert c.kibo("node", "retire", "node-3").returncode == 2
    # An explicit command ID needs an expected version.
    assert c.kibo("node", "retire", "node-3", "--yes", "--command-id", "r3").returncode == 2

    # From DRAINED, with a replayable command.
    kibo_json(c, "node", "drain", "node-3")
    v = version(c, "node-3")
    retired = kibo_json(c, "node", "retire", "node-3", "--yes", "--command-id", "r3",
                        "--expected-version", str(v))["result"]
    assert retired["status"] == "RETIRED"
    assert retired["retired"] is True
    replay = kibo_json(c, "node", "retire", "node-3", "--yes", "--command-id", "r3",
                       "--expected-version", str(v))["result"]
    assert replay == retired

    # Final: no drain, no isolate, no new grant for this node ID.
    assert kibo_json(c, "node", "cancel-drain", "node-3", code=13)
    assert kibo_json(c, "node", "drain", "node-3", code=13)
    assert kibo_json(c, "node", "isolate", "node-3", "--confirm-host-cannot-write", code=13)
    assert kibo_json(c, "enrollment", "create", "--kind", "node", "--node-id", "node-3",
                     code=13)
    # Its session was closed; a restart of its process does not bring it back.
    c.kill_node("node-3", signal.SIGKILL)
    c.start_node("node-3")
    wait_until(lambda: "ctrl rejected the session" in c.node_log("node-3"),
               "ctrl to reject the retired node-3")
    assert c.node("node-3")["status"] == "RETIRED"

    # From isolated.
    c.kill_node("node-1", signal.SIGKILL)
    c.wait_status(["node-1"], "OFFLINE")
    kibo_json(c, "node", "isolate", "node-1", "--confirm-host-cannot-write")
    assert kibo_json(c, "node", "retire", "node-1", "--yes")["result"]["status"] == "RETIRED"
    c.start_node("node-1")  # a new incarnation of a retired node: not admitted
    wait_until(lambda: "ctrl rejected the session" in c.node_log("node-1"),
               "ctrl to reject the retired node-1")
    assert "isolated" not in c.node_log("node-1")
    assert c.node("node-1")["status"] == "RETIRED"

    # Retired after an isolate, a node that comes back with the isolated incarnation
    # still gets the isolation rejection: it destroys its Instances and exits 75.
    c.kill_node("node-2", signal.SIGSTOP)
    c.wait_status(["node-2"], "OFFLINE")
    kibo_json(c, "node", "isolate", "node-2", "--confirm-host-cannot-write")
    kibo_json(c, "node", "retire", "node-2", "--yes")
    c.kill_node("node-2", signal.SIGCONT)
    assert c.wait_node_exit("node-2") == 75
    assert [n["status"] for n in kibo_json(c, "node", "list")["result"]["nodes"]] == [
        "RETIRED", "RETIRED", "RETIRED"]
