"""spec/nodes.txt, walked end to end: the real `kibo` against ctrl and 3 node processes.

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


def table(stdout: str) -> dict[str, dict[str, str]]:
    """An ASCII table of `kibo` (stdout is not a terminal) as {first cell: {column: cell}}."""
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in stdout.splitlines() if line.startswith("|")]
    header, body = rows[0], rows[1:]
    return {row[0]: dict(zip(header, row, strict=True)) for row in body}


# ---------------------------------------------------------------------------- list, get


def test_list_and_get_fields_and_columns(dev_cluster, kibo_json):
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
    rows = table(listing.stdout)
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
    wide = table(c.kibo("node", "list", "--wide").stdout)
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


# ---------------------------------------------------------------------------- overcommit


def test_overcommit_bounds_decimals_default_and_source(dev_cluster, kibo_json, wait_until):
    c = dev_cluster
    got = kibo_json(c, "node", "overcommit", "get")["result"]
    assert set(got["default"]) == {"cpu", "memory"}
    assert got["overrides"] == []
    version0 = got["version"]

    for bad in ("16.001", "-1", "1.2345", "abc", "nan"):
        assert c.kibo("node", "overcommit", "set-default", "--cpu", bad).returncode == 10, bad
        assert c.kibo("node", "overcommit", "set", "node-1", "--memory", bad).returncode == 10
    assert kibo_json(c, "node", "overcommit", "get")["result"]["version"] == version0
    # Replayable input needs both ratios and the expected version.
    assert c.kibo("node", "overcommit", "set", "node-1", "--cpu", "2",
                  "--command-id", "oc-1").returncode == 2

    node = kibo_json(c, "node", "overcommit", "set", "node-1", "--cpu", "2.5",
                     "--memory", "0.9")["result"]
    assert node["overcommit"]["cpu"] == {"ratio": "2.5", "source": "override"}
    assert node["overcommit"]["memory"] == {"ratio": "0.9", "source": "override"}
    assert node["schedulable"]["cpu_millis"] == 10000
    assert node["schedulable"]["memory_bytes"] == int(8 * GiB * 0.9)

    # `default` clears one item and keeps the other.
    node = kibo_json(c, "node", "overcommit", "set", "node-1", "--cpu", "default")["result"]
    assert node["overcommit"]["cpu"]["source"] == "default"
    assert node["overcommit"]["memory"] == {"ratio": "0.9", "source": "override"}

    # The default applies to every node without an override of that item.
    d = kibo_json(c, "node", "overcommit", "set-default", "--cpu", "4",
                  "--expected-version", str(version0))["result"]
    assert d["default"]["cpu"] == "4"
    assert d["version"] > version0
    for node_id in ("node-1", "node-2"):
        n = c.node(node_id)
        assert n["overcommit"]["cpu"] == {"ratio": "4", "source": "default"}
        assert n["schedulable"]["cpu_millis"] == 16000
    stale = kibo_json(c, "node", "overcommit", "set-default", "--cpu", "3",
                      "--expected-version", str(version0), code=14)
    assert stale["error"]["code"] == "aborted"
    # Three decimals are kept exactly; 0 and 16 are the bounds.
    n = kibo_json(c, "node", "overcommit", "set", "node-2", "--cpu", "1.125",
                  "--memory", "16")["result"]
    assert n["overcommit"]["cpu"]["ratio"] == "1.125"
    assert n["schedulable"]["cpu_millis"] == 4500
    n = kibo_json(c, "node", "overcommit", "set", "node-2", "--cpu", "0")["result"]
    assert n["schedulable"]["cpu_millis"] == 0
    overrides = kibo_json(c, "node", "overcommit", "get")["result"]["overrides"]
    assert {o["node_id"] for o in overrides} == {"node-1", "node-2"}

    # The node confirms each new ratio; until then it is not placeable.
    wait_until(lambda: c.node("node-2")["overcommit"]["confirmed"], "node-2 to confirm")


def test_overcommit_waits_for_the_node_to_confirm(dev_cluster, kibo_json, wait_until):
    """A node that cannot answer (stopped) never confirms: ctrl keeps it unconfirmed,
    drops the session, and the node gets the value again when it reconnects."""
    c = dev_cluster
    c.kill_node("node-2", signal.SIGSTOP)
    try:
        n = kibo_json(c, "node", "overcommit", "set", "node-2", "--cpu", "3")["result"]
        assert n["overcommit"]["confirmed"] is False
        assert n["placement"]["eligible"] is False  # not placeable until confirmed
        c.wait_status(["node-2"], "OFFLINE")
        assert c.node("node-2")["overcommit"]["confirmed"] is False
    finally:
        c.kill_node("node-2", signal.SIGCONT)
    c.wait_ready(["node-2"])
    confirmed = wait_until(lambda: (n := c.node("node-2"))["overcommit"]["confirmed"] and n,
                           "node-2 to confirm after reconnecting")
    assert confirmed["overcommit"]["cpu"] == {"ratio": "3", "source": "override"}
    wait_until(lambda: c.node("node-2")["placement"]["eligible"], "node-2 placeable again")


# ---------------------------------------------------------------------------- test inputs


def test_clock_gate(dev_cluster, wait_until):
    c = dev_cluster
    skew = c.layout.clock_skew_file("node-1")
    skew.write_text("120\n")  # two minutes ahead: beyond the 30 s allowance
    over = wait_until(lambda: (s := c.node("node-1")["latest_session"]["clock"])["over"] and s,
                      "ctrl to measure node-1's clock over the limit")
    assert over["offset_ms"] > 100_000
    assert c.node("node-1")["placement"] == {"eligible": False,
                                             "reason": "clock offset beyond 30 s"}
    assert table(c.kibo("node", "list").stdout)["node-1"]["CLOCK"].endswith("(over)")
    # Within 30 s (less uncertainty) is fine; an offset is still shown.
    skew.write_text("-10\n")
    fine = wait_until(
        lambda: (s := c.node("node-1")["latest_session"]["clock"])["offset_ms"] < 0 and s,
        "ctrl to measure node-1's clock again")
    assert fine["over"] is False
    assert c.node("node-1")["placement"]["eligible"] is True
    assert c.node("node-2")["latest_session"]["clock"]["over"] is False


def test_memory_tight_hysteresis(dev_cluster, wait_until):
    """Tight below 10 % available, clear only above 15 %: at 12 % it stays as it was."""
    from kibotos.dev.layout import write_meminfo

    c = dev_cluster
    proc = c.layout.proc_root("node-1")
    total = 16 * GiB

    def set_available(percent: int) -> int:
        available = total * percent // 100 // 1024 * 1024  # meminfo counts in kB
        write_meminfo(proc, total_bytes=total, available_bytes=available)
        return available

    def sampled(available: int) -> dict | None:
        """The node record once ctrl holds a usage sample taken after the change."""
        n = c.node("node-1")
        usage = n.get("host_usage") or {}
        return n if usage.get("memory_available_bytes") == available else None

    set_available(5)
    n = wait_until(lambda: (r := c.node("node-1"))["memory_tight"] and r, "memory tight")
    assert n["memory_tight_since"]
    assert n["placement"] == {"eligible": False, "reason": "host memory tight"}
    assert table(c.kibo("node", "list").stdout)["node-1"]["MEM_TIGHT"] == "yes"

    n = wait_until(lambda: sampled(set_available(12)), "a sample at 12 %", timeout=120)
    assert n["memory_tight"] is True  # still tight between the two thresholds
    assert n["host_usage"]["memory_tight"] is True

    wait_until(lambda: (set_available(20), c.node("node-1")["memory_tight"] is False)[1],
               "memory tight to clear above 15 %")
    n = wait_until(lambda: sampled(set_available(12)), "a sample at 12 % again", timeout=120)
    assert n["memory_tight"] is False  # and not tight again until below 10 %
    assert n["placement"]["eligible"] is True
    assert c.node("node-2")["memory_tight"] is False


# ---------------------------------------------------------------------------- ctrl restart


def test_ctrl_restart_loses_nothing(dev_cluster, kibo_json, wait_until):
    c = dev_cluster
    v1 = version(c, "node-1")
    drained = kibo_json(c, "node", "drain", "node-1", "--command-id", "keep-1",
                        "--expected-version", str(v1))["result"]
    kibo_json(c, "node", "overcommit", "set", "node-2", "--cpu", "2.5", "--memory", "1.5")
    default = kibo_json(c, "node", "overcommit", "set-default", "--memory", "0.8")["result"]
    c.kill_node("node-3", signal.SIGKILL)
    c.wait_status(["node-3"], "OFFLINE")
    kibo_json(c, "node", "isolate", "node-3", "--confirm-host-cannot-write")
    before = {n["node_id"]: n for n in kibo_json(c, "node", "list")["result"]["nodes"]}

    c.restart_ctrl()  # waits until node-1 and node-2 are connected again
    c.wait_status(["node-1"], "DRAINED")

    after = {n["node_id"]: n for n in kibo_json(c, "node", "list")["result"]["nodes"]}
    assert after["node-1"]["drain_requested"] is True
    assert after["node-2"]["overcommit"] == before["node-2"]["overcommit"] | {
        "confirmed": after["node-2"]["overcommit"]["confirmed"]}
    assert after["node-3"]["status"] == "ISOLATED"
    assert after["node-3"]["isolated"] is True
    assert kibo_json(c, "node", "overcommit", "get")["result"]["default"] == default["default"]
    for node_id in ("node-1", "node-2"):  # same processes, same incarnation, new session
        assert (after[node_id]["latest_session"]["incarnation"]
                == before[node_id]["latest_session"]["incarnation"])
        assert (after[node_id]["latest_session"]["session_id"]
                != before[node_id]["latest_session"]["session_id"])
    # The command journal survived: the replay returns the stored result.
    replay = kibo_json(c, "node", "drain", "node-1", "--command-id", "keep-1",
                       "--expected-version", str(v1))["result"]
    assert replay == drained

    # And the sequence goes on: node-3 comes back with a new incarnation.
    c.start_node("node-3")
    c.wait_ready(["node-3"])
    assert c.node("node-3")["isolated"] is False
