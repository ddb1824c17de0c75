#!/usr/bin/env python3
"""Boot time of a bare QEMU microVM: process start to the guest agent's hello.

    .venv/bin/python bench/boot.py [--runs 5] [--cache-dir DIR] [--memory 256M]
                                   [--compression gzip|zstd|none] [--json]

"Bare" means QEMU started directly with the command line the ``qemu`` backend builds
(no wrapper, no supervisor, no node), booting the cached Platform and ``kibotos-base``
Template on a fresh writable layer.  The kibotos path (``bench/boot_cluster.py``: create
→ AVAILABLE through ctrl and a one-node dev cluster, the same kernel and image) runs in
the same invocation, alternating with the bare boots so both see the same machine load,
and the ratio of the medians is printed (target ≤ 1.10).  ``--bare-only`` skips it.

The breakdown comes from the guest console, watched while the guest boots: the init
prints ``kibotos-init: <step> at <uptime>s``, and the host notes when the
``starting agent`` line appears.  So:

    qemu → kernel     host time of "starting agent" − its guest uptime − QEMU start
                      (QEMU setup, firmware, loading the ELF kernel)
    kernel → init     guest uptime when /init starts
    init → agent      modules, disks, overlay root, switch_root (guest uptime)
    agent → hello     Python start of the agent until its hello reaches the host
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import trio
from boot_cluster import BootCluster, ClusterBoot
from kibotos_qemu import cmdline
from kibotos_qemu.launch import parse_launch
from kibotos_qemu.ready import wait_hello

from kibotos.core.units import parse_size
from kibotos.platform.build_platform import build_platform
from kibotos.platform.build_template import build_template, default_recipe
from kibotos.platform.images import create_writable_layer

STAMP = re.compile(rb"kibotos-init: (.+?) at ([0-9.]+)s")


@dataclass
class Boot:
    total: float             # QEMU start -> hello, host clock
    qemu_to_kernel: float
    kernel_to_init: float
    init_to_agent: float
    agent_to_hello: float
    steps: dict[str, float]  # guest uptime of each init step


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as err:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err)


async def _watch_agent_start(console: Path, seen: dict[str, float]) -> None:
    """Note the host time at which the ``starting agent`` line appears."""
    while "starting agent" not in seen:
        if b"kibotos-init: starting agent" in _read(console):
            seen["starting agent"] = time.monotonic()
            return
        await trio.sleep(0.005)


async def bare_boot(platform: Path, template: Path, memory: int, timeout: float) -> Boot:
    run = Path(tempfile.mkdtemp(prefix="kbench-", dir="/tmp"))
    try:
        create_writable_layer(run / "rw.img", 1 << 30)
        launch = parse_launch({
            "instance_id": "bench", "runtime_dir": str(run), "platform_dir": str(platform),
            "template_image": str(template / "image"),
            "writable_layer": str(run / "rw.img"), "memory": memory})
        mhz = cmdline.host_cpu_mhz(_read(Path("/proc/cpuinfo")).decode())
        # The argv the backend's unit runs: the no-THP wrapper exec'ing QEMU (guest RAM
        # without transparent huge pages boots ~0.3 s faster here, so a bare QEMU
        # without it would not be the same boot).
        qemu = shutil.which("qemu-system-x86_64") or "qemu-system-x86_64"
        argv = cmdline.wrapped_argv(qemu, cmdline.qemu_args(launch, "tcg", mhz))
        seen: dict[str, float] = {}
        start = time.monotonic()
        proc = _start(argv, run / "vmm.log")
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch_agent_start, launch.console_log, seen)
                await wait_hello(launch.agent_socket, launch.console_log,
                                 trio.current_time() + timeout)
                hello_at = time.monotonic()
                nursery.cancel_scope.cancel()
        finally:
            proc.kill()
            proc.wait()
        steps = {m.group(1).decode(): float(m.group(2))
                 for m in STAMP.finditer(_read(launch.console_log))}
        agent_host = seen.get("starting agent", hello_at)
        kernel_host = agent_host - steps["starting agent"]
        return Boot(
            total=hello_at - start,
            qemu_to_kernel=kernel_host - start,
            kernel_to_init=steps["init started"],
            init_to_agent=steps["starting agent"] - steps["init started"],
            agent_to_hello=hello_at - agent_host,
            steps=steps,
        )
    finally:
        shutil.rmtree(run, ignore_errors=True)


def _row(name: str, values: list[float]) -> str:
    cells = " ".join(f"{v:6.2f}" for v in values)
    return f"{name:<16} {statistics.median(values):6.2f}   {cells}"


async def main_async(args: argparse.Namespace) -> int:
    platform = build_platform(cache_root=args.cache_dir, compression=args.compression)
    template = build_template(default_recipe(), cache_root=args.cache_dir)
    memory = parse_size(args.memory)
    boots: list[Boot] = []
    kib: list[ClusterBoot] = []
    cluster = None
    if not args.bare_only:
        cluster = BootCluster(Path(tempfile.mkdtemp(prefix="kbc-", dir="/tmp")),
                              args.cache_dir, args.timeout)
        await trio.to_thread.run_sync(cluster.up)
    try:
        for _ in range(args.runs):
            boots.append(await bare_boot(platform, template, memory, args.timeout))
            if cluster is not None:
                kib.append(await trio.to_thread.run_sync(cluster.boot, memory))
    finally:
        if cluster is not None:
            await trio.to_thread.run_sync(cluster.down)
            shutil.rmtree(cluster.cluster.dir, ignore_errors=True)
    if args.json:
        print(json.dumps({"platform": str(platform), "template": str(template),
                          "bare": [asdict(b) for b in boots],
                          "kibotos": [asdict(k) for k in kib]}, indent=2))
        return 0
    print(f"bare QEMU boot (TCG, {args.memory}), {args.runs} runs; seconds")
    print(f"{'':<16} {'median':>6}   runs")
    for field in ("total", "qemu_to_kernel", "kernel_to_init", "init_to_agent",
                  "agent_to_hello"):
        print(_row(field.replace("_", " "), [getattr(b, field) for b in boots]))
    steps = boots[0].steps
    print("init steps (guest uptime, first run): "
          + ", ".join(f"{k} {v:.2f}" for k, v in steps.items()))
    if kib:
        _print_cluster(boots, kib)
    return 0


def _print_cluster(boots: list[Boot], kib: list[ClusterBoot]) -> None:
    print(f"\nkibotos create -> AVAILABLE (1-node dev cluster, qemu backend), {len(kib)} runs")
    print(_row("total", [k.total for k in kib]))
    print(_row("create accepted", [k.accepted for k in kib]))
    print(_row("guest to agent", [k.guest_uptime_agent for k in kib]))
    bare = statistics.median(b.total for b in boots)
    ours = statistics.median(k.total for k in kib)
    guest = statistics.median(k.guest_uptime_agent for k in kib)
    bare_guest = statistics.median(b.kernel_to_init + b.init_to_agent for b in boots)
    print(f"ratio create->ready / bare boot (medians): {ours / bare:.2f}  (target <= 1.10)")
    print(f"where the extra {ours - bare:+.2f} s goes: guest kernel+init "
          f"{guest - bare_guest:+.2f} s vs bare (same image; layer and machine load), "
          f"the rest ({ours - bare - (guest - bare_guest):+.2f} s) is host side: "
          "placement, node admission, layer, launch record, unit start, hello, "
          "guest configuration, the state reaching ctrl")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--memory", default="256M")
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--compression", default="gzip", choices=("gzip", "zstd", "none"),
                        help="initramfs compression of the Platform to boot")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--bare-only", action="store_true",
                        help="skip the kibotos path (no dev cluster)")
    return trio.run(main_async, parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
