"""How a ``Node`` record (the API's JSON, as is) reads for people.

The column and section rules are the spec's (spec/nodes.txt, "list and get" and "Host
usage"): RELEASE shows ``unreleased`` or ``-``; CLOCK shows the offset node minus ctrl,
``(over)`` beyond the allowed one, and ``-`` while the control connection is down; CPU
in cores, memory in the largest binary unit with one decimal; a host usage item that
could not be read is ``-`` (never 0), and the VM items are absent when the node has
none.  Pure functions of the JSON, so they are tested on fixed fixtures.
"""

from __future__ import annotations

from typing import Any

from kibotos.cli.core.output import Section, dash, yes_no
from kibotos.core.units import format_bytes, format_cores

LIST_COLUMNS = ("NODE", "STATUS", "RELEASE", "CLOCK", "INSTANCES", "CPU_ALLOC/SCHED",
                "MEM_ALLOC/SCHED", "MEM_TIGHT")
WIDE_COLUMNS = (*LIST_COLUMNS, "REG_VERSION")


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _num(value: Any) -> float | None:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def cores(millis: Any) -> str:
    return "-" if _num(millis) is None else format_cores(int(millis))


def size(n: Any) -> str:
    return "-" if _num(n) is None else format_bytes(int(n))


def percent(ratio: Any) -> str:
    value = _num(ratio)
    return "-" if value is None else f"{value * 100:.1f}%"


def release(node: dict[str, Any]) -> str:
    session = _dict(node.get("latest_session"))
    version = session.get("release_version")
    if not version:
        return "-"
    return "unreleased" if ".dev" in str(version) else str(version)


def offset(ms: float) -> str:
    """A clock offset with its sign: ``+0.8ms`` below 10 ms, ``+12ms`` below a second,
    ``-31.2s`` above."""
    if abs(ms) < 9.95:
        return f"{'-' if ms < 0 and round(ms, 1) != 0 else '+'}{abs(ms):.1f}ms"
    if abs(ms) < 999.5:
        whole = round(ms)
        return f"{'-' if whole < 0 else '+'}{abs(whole)}ms"
    return f"{'-' if ms < 0 else '+'}{abs(ms) / 1000:.1f}s"


def _clock(node: dict[str, Any]) -> dict[str, Any] | None:
    """The latest clock measurement, or None while the control connection is down."""
    session = _dict(node.get("latest_session"))
    clock = _dict(session.get("clock"))
    if not session.get("alive") or _num(clock.get("offset_ms")) is None:
        return None
    return clock


def clock_cell(node: dict[str, Any]) -> str:
    clock = _clock(node)
    if clock is None:
        return "-"
    text = offset(clock["offset_ms"])
    return f"{text} (over)" if clock.get("over") else text


def _alloc_sched(node: dict[str, Any], key: str, fmt: Any) -> str:
    allocated = _dict(_dict(node.get("latest_report")).get("allocated")).get(key)
    schedulable = _dict(node.get("schedulable")).get(key)
    return f"{fmt(allocated)}/{fmt(schedulable)}"


def list_row(node: dict[str, Any], *, wide: bool = False) -> list[str]:
    report = node.get("latest_report")
    row = [
        dash(node.get("node_id")),
        dash(node.get("status")),
        release(node),
        clock_cell(node),
        dash(_dict(report).get("instance_count")) if report else "-",
        _alloc_sched(node, "cpu_millis", cores),
        _alloc_sched(node, "memory_bytes", size),
        yes_no(node.get("memory_tight")),
    ]
    if wide:
        row.append(dash(node.get("registration_version")))
    return row


# ---------------------------------------------------------------------------- get


def _since(flag: Any, since: Any) -> str:
    if flag is None:
        return "-"
    if flag and since:
        return f"yes (since {since})"
    return yes_no(flag)


def _registration(node: dict[str, Any], wide: bool) -> Section:
    s = Section(f"Node {dash(node.get('node_id'))}")
    s.add("Status", dash(node.get("status")))
    s.add("Admission", dash(node.get("admission")))
    s.add_fields(node, {"Drain requested": "drain_requested", "Isolated": "isolated",
                        "Retired": "retired"}, yes_no)
    placement = _dict(node.get("placement"))
    if "eligible" in placement:
        s.add("Placement", "eligible" if placement["eligible"] else
              f"not eligible ({dash(placement.get('reason'))})")
    if wide:
        s.add("Registration version", dash(node.get("registration_version")))
    return s


def _session(node: dict[str, Any], wide: bool) -> Section:
    s = Section("Latest session")
    session = node.get("latest_session")
    if not isinstance(session, dict):
        s.add("Session", "- (the node has never connected)")
        return s
    s.add("Alive", yes_no(session.get("alive")))
    if wide:
        s.add("Incarnation", dash(session.get("incarnation")))
        s.add("Session ID", dash(session.get("session_id")))
        s.add("Release version", release(node))
        s.add("Source revision", dash(session.get("source_revision")))
    s.add("Started", dash(session.get("started_at")))
    if session.get("ended_at"):
        s.add("Ended", str(session["ended_at"]))
    clock = _clock(node)
    if clock is None:
        s.add("Clock offset", "-")
    else:
        text = clock_cell(node)
        uncertainty = _num(clock.get("uncertainty_ms"))
        if uncertainty is not None:
            text += f" ±{offset(uncertainty).lstrip('+')}"
        if clock.get("measured_at"):
            text += f" (measured {clock['measured_at']})"
        s.add("Clock offset", text)
        s.add("Clock sync", dash(clock.get("sync_status")))
    return s


def _report(node: dict[str, Any]) -> Section:
    s = Section("Latest full report")
    report = node.get("latest_report")
    if not isinstance(report, dict):
        s.add("Report", "- (none received)")
        return s
    allocated = _dict(report.get("allocated"))
    s.add("Reported at", dash(report.get("at")))
    s.add("Allocated CPU", f"{cores(allocated.get('cpu_millis'))} cores")
    s.add("Allocated memory", size(allocated.get("memory_bytes")))
    s.add("Instances", dash(report.get("instance_count")))
    s.add("Volumes", dash(report.get("volume_count")))
    return s


def _ratio(overcommit: dict[str, Any], key: str) -> str:
    item = _dict(overcommit.get(key))
    if item.get("ratio") is None:
        return "-"
    return f"× {item['ratio']} ({dash(item.get('source'))})"


def _schedulable(node: dict[str, Any]) -> Section:
    s = Section("Schedulable and overcommit")
    resources = _dict(node.get("resources"))
    schedulable = _dict(node.get("schedulable"))
    overcommit = _dict(node.get("overcommit"))
    s.add("CPU", f"{cores(resources.get('cpu_millis'))} cores {_ratio(overcommit, 'cpu')} = "
                 f"{cores(schedulable.get('cpu_millis'))} cores schedulable")
    s.add("Memory", f"{size(resources.get('memory_bytes'))} {_ratio(overcommit, 'memory')} = "
                    f"{size(schedulable.get('memory_bytes'))} schedulable")
    confirmed = overcommit.get("confirmed")
    s.add("Overcommit confirmed",
          "no (no placement until the node confirms)" if confirmed is False
          else yes_no(confirmed))
    return s


def _pressure(value: Any) -> str:
    item = _dict(value)
    if not item:
        return "-"
    return f"some {percent(item.get('some'))}, full {percent(item.get('full'))}"


def _host_usage(node: dict[str, Any]) -> Section:
    s = Section("Host usage")
    usage = _dict(node.get("host_usage"))
    if _num(usage.get("vm_cpu_cores")) is not None:
        s.add("VM CPU", f"{usage['vm_cpu_cores']:.2f} cores")
    if _num(usage.get("vm_memory_bytes")) is not None:
        s.add("VM memory", size(usage["vm_memory_bytes"]))
    available = _num(usage.get("memory_available_bytes"))
    total = _num(usage.get("memory_total_bytes"))
    if available is None:
        s.add("Memory available", "-")
    elif total:
        s.add("Memory available",
              f"{size(available)} of {size(total)} ({percent(available / total)})")
    else:
        s.add("Memory available", size(available))
    tight = usage.get("memory_tight", node.get("memory_tight"))
    since = usage.get("memory_tight_since", node.get("memory_tight_since"))
    s.add("Memory tight", _since(tight, since))
    s.add("CPU idle", percent(usage.get("cpu_idle_ratio")))
    s.add("CPU pressure", _pressure(usage.get("cpu_pressure")))
    s.add("Memory pressure", _pressure(usage.get("memory_pressure")))
    s.add("Sampled at", dash(usage.get("at")))
    return s


def get_sections(node: dict[str, Any], *, wide: bool = False) -> list[Section]:
    return [_registration(node, wide), _session(node, wide), _report(node),
            _schedulable(node), _host_usage(node)]
