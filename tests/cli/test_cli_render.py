"""What people see: `kibo node list` and `node get` rendered from fixed JSON."""

from __future__ import annotations

import json

import pytest
from cli_nodes import GIB, USAGE, node, offline, over

from kibotos.cli.cluster import node_render
from kibotos.ctrl.wire.base import NodeListOut, NodeOut


def test_fixtures_match_the_wire_contract():
    # The fixtures stand for ctrl's answers only if ctrl's own result model accepts them.
    NodeListOut.model_validate({"nodes": [node(), offline(), over()],
                                "next_page_token": None})
    NodeOut.model_validate(node(host_usage=USAGE))


def _rows(text: str) -> list[list[str]]:
    """The cells of an ASCII table, header first."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not set(line) <= set("|-+"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def _list_page(fake, *nodes, token=None):
    fake.route("GET", "/v1/nodes", (200, {"result": {"nodes": list(nodes),
                                                     "next_page_token": token}}))


def test_list_columns_units_dash_and_over(kibo, fake_ctrl):
    _list_page(fake_ctrl, node(), offline(), over())
    result = kibo("node", "list")
    assert result.exit_code == 0, result.stderr
    header, *rows = _rows(result.stdout)
    assert header == ["NODE", "STATUS", "RELEASE", "CLOCK", "INSTANCES", "CPU_ALLOC/SCHED",
                      "MEM_ALLOC/SCHED", "MEM_TIGHT"]
    assert rows[0] == ["node-a", "READY", "0.2.0", "+12ms", "2", "1.5/10", "2.0GiB/8.0GiB",
                       "no"]
    # Session down: CLOCK is '-', and no release ever reported: RELEASE is '-'.
    assert rows[1] == ["node-b", "OFFLINE", "-", "-", "-", "-/10", "-/8.0GiB", "no"]
    assert rows[2] == ["node-c", "READY", "unreleased", "+31.2s (over)", "2", "1.5/10",
                       "2.0GiB/8.0GiB", "yes"]
    sent = fake_ctrl.sent("GET", "/v1/nodes")[0]
    assert sent.query == {"page_size": "100", "order_by": "node_id"}
    assert sent.headers["authorization"].startswith("Bearer kid-")


def test_list_wide_adds_reg_version(kibo, fake_ctrl):
    _list_page(fake_ctrl, node(), offline())
    header, *rows = _rows(kibo("node", "list", "--wide").stdout)
    assert header[-1] == "REG_VERSION"
    assert [r[-1] for r in rows] == ["7", "12"]


def test_list_is_ascii_and_fits_columns(kibo, fake_ctrl):
    _list_page(fake_ctrl, node())
    out = kibo("node", "list", env={"COLUMNS": "200"}).stdout
    assert out.isascii()
    assert out.splitlines()[0].startswith("+")
    # Borders start with '+', so every line starting with '|' is a row of cells.
    cells = [line.count("|") for line in out.splitlines() if line.startswith("|")]
    assert cells == [9, 9]
    assert max(len(line) for line in out.splitlines()) <= 200


def test_list_json_is_the_api_result_as_is(kibo, fake_ctrl):
    page = {"nodes": [node(), offline()], "next_page_token": "t2"}
    fake_ctrl.route("GET", "/v1/nodes", (200, {"result": page}))
    result = kibo("node", "list", "--json", "--page-size", "2")
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {"result": page}
    assert fake_ctrl.sent()[0].query["page_size"] == "2"


def test_list_pages(kibo, fake_ctrl):
    def page(rec):
        if rec.query.get("page_token") == "t2":
            return 200, {"result": {"nodes": [offline()], "next_page_token": None}}
        return 200, {"result": {"nodes": [node()], "next_page_token": "t2"}}

    fake_ctrl.route("GET", "/v1/nodes", page)
    one = kibo("node", "list", "--page-size", "1")
    assert [r[0] for r in _rows(one.stdout)[1:]] == ["node-a"]
    assert "--page-token t2" in one.stderr
    two = kibo("node", "list", "--page-token", "t2")
    assert [r[0] for r in _rows(two.stdout)[1:]] == ["node-b"]
    every = kibo("node", "list", "--all", "--json")
    assert [n["node_id"] for n in json.loads(every.stdout)["result"]["nodes"]] == [
        "node-a", "node-b"]


def _lines(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line.startswith("  ") and ":" in line:
            label, _, value = line.strip().partition(":")
            out[label] = value.strip()
    return out


def test_get_sections_and_host_usage(kibo, fake_ctrl):
    fake_ctrl.route("GET", "/v1/nodes/node-a", (200, {"result": node(host_usage=USAGE)}))
    result = kibo("node", "get", "node-a")
    assert result.exit_code == 0, result.stderr
    text = result.stdout
    for title in ("Node node-a", "Latest session", "Latest full report",
                  "Schedulable and overcommit", "Host usage"):
        assert f"\n{title}\n" in f"\n{text}"
    lines = _lines(text)
    assert lines["Status"] == "READY"
    assert lines["Clock offset"] == "+12ms ±0.8ms (measured 2026-11-29T15:01:00.000Z)"
    assert lines["Clock sync"] == "synchronized"
    assert lines["Allocated CPU"] == "1.5 cores"
    assert lines["Allocated memory"] == "2.0GiB"
    assert lines["Instances"] == "2"
    assert lines["Volumes"] == "3"
    assert lines["CPU"] == "4 cores × 2.5 (override) = 10 cores schedulable"
    assert lines["Memory"] == "8.0GiB × 1 (default) = 8.0GiB schedulable"
    assert lines["VM CPU"] == "1.25 cores"
    assert lines["VM memory"] == "1.5GiB"
    assert lines["Memory available"] == "4.0GiB of 16.0GiB (25.0%)"
    assert lines["Memory tight"] == "no"
    assert lines["CPU idle"] == "72.5%"
    assert lines["CPU pressure"] == "some 1.2%, full 0.0%"
    # Without --wide: no registration version, incarnation, session ID or versions.
    for wide_only in ("Registration version", "Incarnation", "Session ID",
                      "Release version", "Source revision"):
        assert wide_only not in lines


def test_get_wide(kibo, fake_ctrl):
    fake_ctrl.route("GET", "/v1/nodes/node-a", (200, {"result": node()}))
    lines = _lines(kibo("node", "get", "node-a", "--wide").stdout)
    assert lines["Registration version"] == "7"
    assert lines["Incarnation"] == "3"
    assert lines["Session ID"] == "ses-01k6aaaaaaaaaaaaaaaaaaaaaa"
    assert lines["Release version"] == "0.2.0"
    assert lines["Source revision"] == "abc1234"


def test_get_unreadable_usage_is_dash_and_vm_items_absent():
    usage = {**USAGE, "vm_cpu_cores": None, "vm_memory_bytes": None,
             "memory_available_bytes": None, "cpu_idle_ratio": None, "cpu_pressure": None,
             "memory_tight": True, "memory_tight_since": "2026-11-29T15:00:30.000Z"}
    sections = node_render.get_sections(node(host_usage=usage))
    host = dict(sections[-1].lines)
    assert "VM CPU" not in host
    assert "VM memory" not in host
    assert host["Memory available"] == "-"
    assert host["CPU idle"] == "-"
    assert host["CPU pressure"] == "-"
    assert host["Memory pressure"] == "some 0.0%, full 0.0%"
    assert host["Memory tight"] == "yes (since 2026-11-29T15:00:30.000Z)"


def test_get_session_down_and_no_report():
    sections = {s.title: dict(s.lines) for s in node_render.get_sections(offline())}
    assert sections["Latest session"]["Alive"] == "no"
    assert sections["Latest session"]["Clock offset"] == "-"
    assert sections["Latest full report"] == {"Report": "- (none received)"}
    assert sections["Host usage"]["Memory available"] == "-"


def test_get_over_and_unconfirmed_overcommit():
    n = over()
    n["overcommit"]["confirmed"] = False
    sections = {s.title: dict(s.lines) for s in node_render.get_sections(n, wide=True)}
    assert sections["Latest session"]["Clock offset"].startswith("+31.2s (over) ±0.8ms")
    assert sections["Latest session"]["Release version"] == "unreleased"
    assert sections["Schedulable and overcommit"]["Overcommit confirmed"].startswith("no")


@pytest.mark.parametrize(("ms", "text"), [
    (0.02, "+0.0ms"), (-0.02, "+0.0ms"), (0.8, "+0.8ms"), (-3.25, "-3.2ms"),
    (9.96, "+10ms"), (12.4, "+12ms"), (-999.0, "-999ms"),
    (999.6, "+1.0s"), (-31234.0, "-31.2s"), (125000.0, "+125.0s"),
])
def test_offset_format(ms, text):
    assert node_render.offset(ms) == text


def test_memory_units():
    assert node_render.size(512) == "512B"
    assert node_render.size(1536 * 2**20) == "1.5GiB"
    assert node_render.size(3 * 2**40) == "3.0TiB"
    assert node_render.size(None) == "-"
    assert node_render.cores(250) == "0.25"
    assert GIB == 2**30


@pytest.mark.parametrize("columns", ["40", "80", "120"])
def test_narrow_columns_never_cut_data(kibo, fake_ctrl, columns):
    _list_page(fake_ctrl, node(), offline(), over())
    out = kibo("node", "list", "--wide", env={"COLUMNS": columns}).stdout
    for word in ("NODE", "INSTANCES", "CPU_ALLOC/SCHED", "MEM_ALLOC/SCHED", "REG_VERSION",
                 "unreleased", "+31.2s", "(over)", "2.0GiB/8.0GiB", "-/8.0GiB"):
        assert word in out
    assert "+31.2s (over)" in out  # cells never wrap
    assert len({len(line) for line in out.splitlines()}) == 1  # and no line is cut
