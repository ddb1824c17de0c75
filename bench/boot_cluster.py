"""The kibotos half of ``bench/boot.py``: create → guest ready through ctrl and a node.

A one-node dev cluster with the ``qemu`` backend (``kibotos.dev.cluster.DevCluster``), the
``kibotos-base`` Template published with ``kibo template build`` (the same build cache as
the bare boots, so both boot the same kernel, initramfs and image), then per run:

    POST /v1/workspaces            → accepted (placement, the node's admission)
    GET  /v1/workspaces/{id}?wait_s → AVAILABLE (layer, launch record, unit, boot,
                                      hello, guest configuration, instance_state)

then ``stop --force`` and ``delete``, so every run boots a fresh Instance on a fresh
writable layer, as the bare boot does.  The guest's own console stamps are read from the
Instance directory while it runs, so the report splits the kibotos path the same way as
the bare one and shows where the extra time goes: before QEMU starts (ctrl, session,
node admission, layer, Template links, launch record, unit start) and after the hello
(guest configuration, the state reaching ctrl, the wait answering).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kibotos.dev.cluster import DevCluster, script
from kibotos.dev.layout import storage_root

STAMP = re.compile(rb"kibotos-init: (.+?) at ([0-9.]+)s")
TEMPLATE = "kibotos-base"
RECIPE = Path(__file__).resolve().parent.parent / "packaging/template/kibotos-base.toml"


@dataclass
class ClusterBoot:
    total: float            # POST create -> the wait answers AVAILABLE
    accepted: float         # POST create answered (placement and the node's admission)
    guest_uptime_agent: float  # guest uptime when the agent started (kernel + init)
    steps: dict[str, float]


class BootCluster:
    """A dev cluster kept for all runs of one bench invocation."""

    def __init__(self, directory: Path, cache_dir: Path | None, timeout: float) -> None:
        self.cluster = DevCluster(directory, timeout=120.0)
        self.cache_dir = cache_dir
        self.timeout = timeout

    def up(self) -> None:
        self.cluster.up(1, vmm_backend="qemu", cpu="2", memory="8G")
        argv = [script("kibo"), "template", "build", TEMPLATE, "--recipe", str(RECIPE)]
        if self.cache_dir is not None:
            argv += ["--cache-dir", str(self.cache_dir)]
        env = {**os.environ, "KIBO_CONFIG": str(self.cluster.layout.kibo_config)}
        done = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"kibo template build failed: {done.stderr.strip()}")

    def down(self) -> None:
        self.cluster.down(grace=10.0)

    def _wait(self, ws_id: str, wanted: str, deadline: float) -> dict[str, Any]:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"workspace {ws_id} not {wanted} in time")
            ws: dict[str, Any] = self.cluster.api(
                "GET", f"/v1/workspaces/{ws_id}", params={"wait_s": min(25.0, left)})
            if ws["state"] == wanted:
                return ws
            if ws["state"] == "FAILED":
                raise RuntimeError(f"workspace {ws_id} FAILED: {ws.get('reason')}")

    def _console(self, instance_id: str) -> bytes:
        node_id = self.cluster.layout.node_ids()[0]
        path = (storage_root(self.cluster.layout.node_dir(node_id)) / "runtime" / "instances"
                / instance_id / "console.log")
        try:
            return path.read_bytes()
        except OSError:
            return b""

    def boot(self, memory: int) -> ClusterBoot:
        start = time.monotonic()
        ws = self.cluster.api("POST", "/v1/workspaces",
                              json={"template": TEMPLATE, "memory_bytes": memory})
        accepted = time.monotonic()
        ws = self._wait(ws["workspace_id"], "AVAILABLE", start + self.timeout)
        ready = time.monotonic()
        instance_id = ws["instance_id"]
        steps = {m.group(1).decode(): float(m.group(2))
                 for m in STAMP.finditer(self._console(str(instance_id)))}
        ws_id = ws["workspace_id"]
        self.cluster.api("POST", f"/v1/workspaces/{ws_id}/stop", json={"force": True})
        self._wait(ws_id, "STOPPED", time.monotonic() + self.timeout)
        self.cluster.api("POST", f"/v1/workspaces/{ws_id}/delete", json={})
        return ClusterBoot(total=ready - start, accepted=accepted - start,
                           guest_uptime_agent=steps.get("starting agent", float("nan")),
                           steps=steps)
