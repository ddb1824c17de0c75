#!/usr/bin/env python3
"""Workspace networking in one run: per-Instance network setup and teardown, and guest
TCP direct and through the egress process, each as ratios against baselines measured
in the same run (issue 11, "Done when").

    sudo .venv/bin/python bench/net.py [--runs 20] [--connects 100] [--mib 64] [--json]

Two parts, each the bench of its own with the same options (this one runs both and
prints the figures side by side):

* `bench/net_setup.py`: one Instance's network set up (record, namespace, veth, tap,
  addresses, slot table) and torn down, in a host namespace of its own; baselines: a
  bare named namespace created, a veth pair deleted; target ≤ 50 ms each.
* `bench/egress.py`: connect latency (connect, one byte echoed, close) and throughput
  to the test host (198.18.0.1 in the network tests' world) from the host namespace (no
  VM: the baseline), from a namespace on a plain veth pair without nftables, from a
  guest stand-in direct (slot table, masquerade), and from a guest through the egress
  process and a SOCKS5 server (microsocks, username and password).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import egress as egress_bench  # noqa: E402
import net_setup  # noqa: E402
import trio  # noqa: E402


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


def report(setup: dict[str, object], paths: dict[str, dict[str, float]]) -> None:
    print(f"Instance network, {setup['runs']} runs (medians; target <= 50 ms each):")
    print(f"  setup     {setup['setup_ms']:7.2f} ms  (p90 {setup['setup_p90_ms']} ms) = "
          f"{setup['setup_vs_bare_netns']} x a bare named netns created "
          f"({setup['baseline_create_ms']} ms)")
    print(f"  teardown  {setup['teardown_ms']:7.2f} ms  (p90 {setup['teardown_p90_ms']} ms) = "
          f"{setup['teardown_vs_veth_delete']} x a veth pair deleted "
          f"({setup['baseline_veth_delete_ms']} ms)")
    steps = setup["setup_steps_ms"]
    assert isinstance(steps, dict)
    print("  where setup's time goes: " + ", ".join(f"{k} {v} ms" for k, v in steps.items()))
    moves = paths.pop("handover")
    print(f"  with an Egress, setup adds {moves['serve_ms']:.2f} ms (the egress process "
          f"given the Instance: state, sockets) and teardown {moves['release_ms']:.2f} ms")
    host = paths["host"]
    print("TCP to the test host (connect + 1 byte echoed, median; throughput):")
    print(f"  {'path':8} {'connect':>10} {'vs host':>8} {'MiB/s':>9} {'vs host':>8}")
    for name, r in paths.items():
        connect = ratio(r["connect_ms"], host["connect_ms"])
        print(f"  {name:8} {r['connect_ms']:7.2f} ms {connect:>8} "
              f"{r['mib_per_s']:9.1f} {ratio(r['mib_per_s'], host['mib_per_s']):>8}")
    direct, egress, veth = paths["direct"], paths["egress"], paths["veth"]
    print(f"  egress/direct: connect {ratio(egress['connect_ms'], direct['connect_ms'])}, "
          f"throughput {ratio(egress['mib_per_s'], direct['mib_per_s'])}; "
          f"direct/veth: connect {ratio(direct['connect_ms'], veth['connect_ms'])}, "
          f"throughput {ratio(direct['mib_per_s'], veth['mib_per_s'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--connects", type=int, default=100)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/net.py needs root (network namespaces)")
    setup = net_setup.run(args.runs)
    paths = trio.run(egress_bench.measure, args)
    if args.json:
        print(json.dumps({"setup": setup, "tcp": paths}, indent=2))
        return
    report(setup, paths)


if __name__ == "__main__":
    main()
