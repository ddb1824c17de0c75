#!/usr/bin/env python3
"""Time to set up and tear down one Instance's network (target: ≤ 50 ms each).

    sudo .venv/bin/python bench/net_setup.py [--runs 20] [--json]

Runs in a host namespace of its own (a stand-in for the node's, with an uplink ``up0``
and the node's host table), never in the machine's.  Per run:

    setup      the network record allocated (durable write), `plumbing.setup` (namespace,
               sysctls, veth, tap, addresses, routes) and `enforce.write_table` (the slot
               table in one nft transaction, the record updated)
    teardown   `plumbing.teardown` (tap, veth, namespace) and the record removed

each beside baselines of the same run, so the figures are ratios that depend less on the
machine: for setup, creating one bare named network namespace (`netns.create_netns`);
for teardown, deleting one veth pair (the kernel's unregistration of a device, an RCU
grace period, is most of a teardown; unbinding a bare namespace returns at once and
leaves its destruction to a kernel worker).  Then, from separate runs of the steps
alone, where the setup time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kibotos.network_config import NetworkSection  # noqa: E402
from kibotos.node.network import enforce, host_table, plumbing  # noqa: E402
from kibotos.node.network import netns as ns  # noqa: E402
from kibotos.node.network.policy import NetworkPolicy  # noqa: E402
from kibotos.node.network.records import NetworkRecords  # noqa: E402
from kibotos.node.network.tap import create_tap  # noqa: E402

SCOPE = "be4c0000"
CONFIG = NetworkSection(ipv4_pool="10.201.0.0/16", ipv6_pool="fd00:6b6a::/112",
                        management_cidrs=["10.99.0.0/24"], uplink="up0",
                        public_egress=True, resolvers=["198.18.0.1"])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_host() -> Path:
    host = Path("/run/netns") / f"kbt-bench-{os.getpid()}"
    ns.create_netns(host)
    try:  # an uplink with an address (a veth: this kernel may lack the dummy driver)
        for argv in (["link", "add", "up0", "type", "veth", "peer", "name", "up0p"],
                     ["link", "set", "up0", "up"], ["addr", "add", "198.18.0.2/24", "dev", "up0"]):
            subprocess.run(["ip", "-n", host.name, *argv], check=True)
        host_table.prepare_host(CONFIG, SCOPE, host_netns=host)
    except BaseException:
        ns.remove_netns(host)
        raise
    return host


def baselines(host: Path) -> tuple[float, float]:
    """One bare named netns created; one veth pair deleted."""
    bare = Path("/run/netns") / f"kbt-bench-bare-{os.getpid()}"
    create = timed(lambda: ns.create_netns(bare))
    ns.remove_netns(bare)
    subprocess.run(["ip", "-n", host.name, "link", "add", "kbtb0", "type", "veth", "peer",
                    "name", "kbtb1"], check=True)
    with ns.netlink(host) as ipr:
        index = ipr.link_lookup(ifname="kbtb0")[0]
        delete = timed(lambda: ipr.link("del", index=index))
    return create, delete


def one_instance(host: Path, records: NetworkRecords, instance_id: str) -> tuple[float, float]:
    """Setup and teardown of one Instance's network, as the lifecycle will call them."""

    def setup() -> None:
        uplink = enforce.uplink_addresses(CONFIG, host)
        record = records.allocate(instance_id, SCOPE, CONFIG, NetworkPolicy(), uplink)
        plumbing.setup(record, host_netns=host)
        enforce.write_table(records, record, CONFIG, uplink)

    def teardown() -> None:
        record = records.read(instance_id)
        assert record is not None
        plumbing.teardown(record.names, host_netns=host)
        records.remove(instance_id)

    return timed(setup), timed(teardown)


def setup_steps(host: Path, records: NetworkRecords, instance_id: str) -> dict[str, float]:
    """The steps of a setup one by one (plumbing's private helpers), for the breakdown."""
    uplink = enforce.uplink_addresses(CONFIG, host)
    t0 = time.perf_counter()
    record = records.allocate(instance_id, SCOPE, CONFIG, NetworkPolicy(), uplink)
    took = {"record": time.perf_counter() - t0}
    path = record.names.netns_path()
    took["netns"] = timed(lambda: ns.create_netns(path))
    took["sysctls"] = timed(lambda: ns.write_sysctls(path, plumbing._sysctls(True)))
    took["veth"] = timed(lambda: plumbing._veth(record.names, path, host))
    took["tap"] = timed(lambda: create_tap(path, record.names.tap))
    took["addresses"] = timed(lambda: plumbing._addresses(record, path, host))
    took["table"] = timed(lambda: enforce.write_table(records, record, CONFIG, uplink))
    plumbing.teardown(record.names, host_netns=host)
    records.remove(instance_id)
    return took


def run(runs: int) -> dict[str, object]:
    host = bench_host()
    records = NetworkRecords(Path(tempfile.mkdtemp(prefix="kibotos-bench-net-")))
    base_create, base_delete, setups, teardowns = [], [], [], []
    steps: dict[str, list[float]] = {}
    try:
        for i in range(runs):
            create, delete = baselines(host)
            base_create.append(create)
            base_delete.append(delete)
            setup, teardown = one_instance(host, records, f"inst-bench-{i}")
            setups.append(setup)
            teardowns.append(teardown)
            for step, took in setup_steps(host, records, f"inst-step-{i}").items():
                steps.setdefault(step, []).append(took)
    finally:
        ns.remove_netns(host)
    median = statistics.median
    base_c, base_d = median(base_create), median(base_delete)

    def ms(value: float) -> float:
        return round(value * 1000, 2)

    return {
        "runs": runs,
        "baseline_create_ms": ms(base_c),
        "baseline_veth_delete_ms": ms(base_d),
        "setup_ms": ms(median(setups)),
        "setup_min_ms": ms(min(setups)),
        "setup_p90_ms": ms(percentile(setups, 0.9)),
        "setup_vs_bare_netns": round(median(setups) / base_c, 2),
        "teardown_ms": ms(median(teardowns)),
        "teardown_min_ms": ms(min(teardowns)),
        "teardown_p90_ms": ms(percentile(teardowns, 0.9)),
        "teardown_vs_veth_delete": round(median(teardowns) / base_d, 2),
        "setup_steps_ms": {k: ms(median(v)) for k, v in steps.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/net_setup.py needs root (network namespaces)")
    result = run(args.runs)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{args.runs} runs, medians; baselines: a bare named netns created in "
          f"{result['baseline_create_ms']} ms, a veth pair deleted in "
          f"{result['baseline_veth_delete_ms']} ms")
    print(f"setup     {result['setup_ms']:7.2f} ms = {result['setup_vs_bare_netns']:6.2f} x a bare "
          f"netns create (min {result['setup_min_ms']}, p90 {result['setup_p90_ms']} ms; "
          "target <= 50 ms)")
    print(f"teardown  {result['teardown_ms']:7.2f} ms = {result['teardown_vs_veth_delete']:6.2f} x "
          f"a veth delete (min {result['teardown_min_ms']}, p90 {result['teardown_p90_ms']} ms; "
          "target <= 50 ms)")
    steps = result["setup_steps_ms"]
    assert isinstance(steps, dict)
    print("setup steps: " + ", ".join(f"{k} {v} ms" for k, v in steps.items()))


if __name__ == "__main__":
    main()
