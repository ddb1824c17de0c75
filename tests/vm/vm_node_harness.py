"""A node on the ``qemu`` backend (TCG) for the microVM tests (test_vm_node_instance,
test_vm_node_volume, test_vm_adoption): its config over a base directory, and the
Platform's and ``kibotos-base``'s blobs offered to it by digest in a local artifact
directory, as the node's template cache would hold them."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from kibotos.config import NodeConfig, parse
from kibotos.core import atomicfile
from kibotos.node.instances.lifecycle import Settings

#: Generous for TCG: a guest boots in minutes on a loaded machine.
VM_SETTINGS = Settings(ready_timeout=300, stop_timeout=30, force_sync_timeout=10,
                       monitor_interval=0.5)


def offer(artifacts: Path, source: Path, digest: str) -> str:
    """Put `source` in a ``sha256/<hex>`` directory (hard link, else symbolic), unless
    it is there already."""
    target = artifacts / "sha256" / digest
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        try:
            os.link(source, target)
        except OSError:
            os.symlink(source, target)
    return f"sha256:{digest}"


def template_blobs(artifacts: Path, platform_dir: Path, template_dir: Path) -> dict[str, str]:
    """The Template body naming the Platform's kernel and initramfs and the image."""
    plat = atomicfile.read_json(platform_dir / "platform.json")["files"]
    image = atomicfile.read_json(template_dir / "template.json")["image"]
    return {
        "name": "kibotos-base",
        "image_digest": offer(artifacts, template_dir / image["file"], image["sha256"]),
        "kernel_digest": offer(artifacts, platform_dir / "vmlinux", plat["vmlinux"]["sha256"]),
        "initramfs_digest": offer(artifacts, platform_dir / "initramfs",
                                  plat["initramfs"]["sha256"]),
    }


def qemu_config(base: Path, what: str, *, extra: str = "", node_extra: str = ""
                ) -> NodeConfig:
    """Node ``node-vm`` with its root, pool ``pool-a`` and artifacts under `base`;
    `what` names the config in errors; `extra` adds tables, `node_extra` lines of
    ``[node]``."""
    return parse(NodeConfig, tomllib.loads(qemu_config_text(base, extra=extra,
                                                            node_extra=node_extra)), what)


def qemu_config_text(base: Path, *, extra: str = "", node_extra: str = "") -> str:
    return f"""
[node]
id = "node-vm"
ctrl_url = "http://127.0.0.1:9"
{node_extra}
[storage]
root = "{base / 'root'}"
[[storage.pool]]
id = "pool-a"
path = "{base / 'pool'}"
[resources]
cpu = 2
memory = "2G"
[vmm]
backend = "qemu"
artifact_dirs = ["{base / 'artifacts'}"]
[vmm.qemu]
accelerator = "tcg"
user = "root"  # pytest's 0700 temporary directories (vm_harness.ROOT_TCG)
{extra}"""
