"""spec/nodes.txt, walked end to end (overcommit, the clock gate, memory tight, a ctrl
restart): the real `kibo` against ctrl and 3 node processes.

Each test gets its own dev cluster (tests/e2e/conftest.py): 3 nodes with 4 cores and
8 GiB each, a 2 s reconcile interval, a 5 s session timeout, and the test inputs (clock
skew file, prepared proc tree).  Exit codes are the spec's (12 not found, 13 failed
precondition, 16 timed out) and docs/cli.md's (2 usage, 10 invalid argument,
14 aborted / reused command ID).
"""

from __future__ import annotations

import signal

import pytest

from kibotos.dev import DevCluster

pytestmark = pytest.mark.slow

GiB = 2**30


def version(c: DevCluster, node_id: str) -> int:
    return int(c.node(node_id)["registration_version"])


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


def test_clock_gate(dev_cluster, wait_until, kibo_table):
    c = dev_cluster
    skew = c.layout.clock_skew_file("node-1")
    skew.write_text("120\n")  # two minutes ahead: beyond the 30 s allowance
    over = wait_until(lambda: (s := c.node("node-1")["latest_session"]["clock"])["over"] and s,
                      "ctrl to measure node-1's clock over the limit")
    assert over["offset_ms"] > 100_000
    assert c.node("node-1")["placement"] == {"eligible": False,
                                             "reason": "clock offset beyond 30 s"}
    assert kibo_table(c.kibo("node", "list").stdout)["node-1"]["CLOCK"].endswith("(over)")
    # Within 30 s (less uncertainty) is fine; an offset is still shown.
    skew.write_text("-10\n")
    fine = wait_until(
        lambda: (s := c.node("node-1")["latest_session"]["clock"])["offset_ms"] < 0 and s,
        "ctrl to measure node-1's clock again")
    assert fine["over"] is False
    assert c.node("node-1")["placement"]["eligible"] is True
    assert c.node("node-2")["latest_session"]["clock"]["over"] is False


def test_memory_tight_hysteresis(dev_cluster, wait_until, kibo_table):
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
    assert kibo_table(c.kibo("node", "list").stdout)["node-1"]["MEM_TIGHT"] == "yes"

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
