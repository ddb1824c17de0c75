"""Where a dev cluster keeps its files under DIR, and the config files it writes there.

::

    DIR/kibo.toml                     the operator's CLI config (written by `kibo enroll`)
    DIR/ctrl/ctrl.toml ctrl.log ctrl.pid state/
    DIR/ctrl-<n>/ …                   with `--ctrl-replicas N`: replicas 2 … N, alike
    DIR/postgres/ DIR/artifacts/      with `--store postgresql`: the shared store, blobs
    DIR/nodes/<id>/node.toml node.log node.pid grant root/ pool/
    DIR/nodes/<id>/clock-skew proc/   test inputs, only with `test_inputs`
    DIR/shared-pool/                  with `--shared-pool`: one pool all nodes attach

The layout is the contract with the tests and the docs: a test kills a node and starts
it again with ``kibotos node serve --config DIR/nodes/<id>/node.toml``.  The config
files are validated with the same models the services load, so a file this module
writes is one the service accepts.
"""

from __future__ import annotations

import json
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kibotos import config
from kibotos.core import atomicfile
from kibotos.core.path_tables import Below
from kibotos.node.storage.pools.marker import init_pool

#: Files copied from the real /proc into a node's prepared proc tree (test inputs).
PROC_FILES = ("meminfo", "stat", "loadavg", "uptime", "pressure/cpu", "pressure/memory",
              "pressure/io")


CTRL_HEADER = ("ctrl of a dev cluster, written by `kibotos dev cluster up`.\n"
               "listen starts as port 0; after the first start it holds the port ctrl\n"
               "bound, so a restarted ctrl keeps the address the nodes know.")


@dataclass(frozen=True)
class Layout:
    root: Path

    kibo_config = Below("root", "kibo.toml")
    ctrl_dir = Below("root", "ctrl")
    ctrl_config = Below("ctrl_dir", "ctrl.toml")
    ctrl_state = Below("ctrl_dir", "state")
    #: Written by ``kibotos ctrl serve`` once it has bound its socket.
    listen_address_file = Below("ctrl_state", "listen-address")
    shared_pool = Below("root", "shared-pool")
    #: The PostgreSQL server of ``--store postgresql``.
    postgres_dir = Below("root", "postgres")

    def replica_dir(self, replica: int) -> Path:
        """ctrl replica 1 is DIR/ctrl; the others (``--ctrl-replicas``) DIR/ctrl-<n>."""
        return self.ctrl_dir if replica == 1 else self.root / f"ctrl-{replica}"

    def replica_numbers(self) -> list[int]:
        """1, then the other replicas this cluster has (by their configs)."""
        others = [int(p.name.removeprefix("ctrl-")) for p in self.root.glob("ctrl-*")
                  if p.name.removeprefix("ctrl-").isdigit() and (p / "ctrl.toml").is_file()]
        return [1, *sorted(others)]

    def node_dir(self, node_id: str) -> Path:
        return self.root / "nodes" / node_id

    def node_config(self, node_id: str) -> Path:
        return self.node_dir(node_id) / "node.toml"

    def clock_skew_file(self, node_id: str) -> Path:
        return self.node_dir(node_id) / "clock-skew"

    def proc_root(self, node_id: str) -> Path:
        return self.node_dir(node_id) / "proc"

    def node_ids(self) -> list[str]:
        """The nodes this cluster has, in order node-1, node-2, … (by their configs)."""
        nodes = self.root / "nodes"
        if not nodes.is_dir():
            return []
        found = [p.name for p in nodes.iterdir() if (p / "node.toml").is_file()]
        return sorted(found, key=lambda n: (len(n), n))

    def exists(self) -> bool:
        """Whether DIR holds a dev cluster (its ctrl config has been written)."""
        return self.ctrl_config.is_file()


# ---------------------------------------------------------------------------- TOML


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        # A JSON string with only ASCII is a valid TOML basic string (same escapes).
        return json.dumps(value, ensure_ascii=True)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def _table(name: str, table: dict[str, Any], out: list[str], array: bool = False) -> None:
    out.append("")
    out.append(f"[[{name}]]" if array else f"[{name}]")
    nested = []
    for key, value in table.items():
        if value is None:
            continue
        if isinstance(value, dict) or (
                isinstance(value, list) and value and all(isinstance(v, dict) for v in value)):
            nested.append((key, value))
        else:
            out.append(f"{key} = {_toml_value(value)}")
    for key, value in nested:
        for row in value if isinstance(value, list) else [value]:
            _table(f"{name}.{key}", row, out, array=isinstance(value, list))


def to_toml(doc: dict[str, dict[str, Any]], header: str = "") -> str:
    """Tables of scalars, arrays and nested (arrays of) tables: what our configs use."""
    out = [f"# {line}".rstrip() for line in header.splitlines()]
    for name, table in doc.items():
        _table(name, table, out)
    return "\n".join(out).lstrip("\n") + "\n"


def write_config(path: Path, model: type[config.M], doc: dict[str, Any], header: str) -> None:
    """Validate `doc` as `model` would load it, then write it atomically."""
    config.parse(model, doc, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    atomicfile.write_bytes(path, to_toml(doc, header).encode())


# ---------------------------------------------------------------------------- configs


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_ctrl_config(layout: Layout, *, listen: str, reconcile_interval: str | None,
                      session_timeout: str | None, database_url: str = "") -> None:
    section: dict[str, Any] = {"listen": listen, "state_dir": layout.ctrl_state}
    if database_url:
        # Replicas share the store and the artifact directory (docs/replicas.md).
        section["database_url"] = database_url
        section["artifact_dir"] = layout.root / "artifacts"
    if reconcile_interval:
        section["reconcile_interval"] = reconcile_interval
    if session_timeout:
        section["session_timeout"] = session_timeout
    layout.ctrl_state.mkdir(parents=True, exist_ok=True)
    # Pools get a capacity at their first create (an operator runs `kibo storage-pool
    # set-capacity`; a dev cluster is for trying Workspaces).
    write_config(layout.ctrl_config, config.CtrlConfig,
                 {"ctrl": section, "testing": {"pool_capacity": "1T"}}, CTRL_HEADER)


def write_node_config(layout: Layout, node_id: str, *, ctrl_url: str | list[str], cpu: str,
                      memory: str,
                      shared_pool: bool, test_inputs: bool, ctrl_ca_file: Path | None = None,
                      vmm_backend: str | None = None, shared_default: bool = False,
                      vmm_options: Mapping[str, Any] | None = None,
                      network: Mapping[str, Any] | None = None,
                      testing: Mapping[str, Any] | None = None) -> None:
    """`network` is the node's ``[network]`` table as an operator writes it
    (docs/network.md), `testing` keys of its ``[testing]`` (docs/dev.md)."""
    d = layout.node_dir(node_id)
    pools: list[dict[str, Any]] = [
        {"id": node_id, "path": d / "pool", "default": not shared_default, "shared": False},
    ]
    if shared_pool or shared_default:
        pools.append({"id": "shared", "path": layout.shared_pool, "default": shared_default,
                      "shared": True})
    doc: dict[str, Any] = {
        "node": {
            "id": node_id,
            "ctrl_url": ctrl_url,
            "ctrl_ca_file": ctrl_ca_file,
            "enrollment_grant_file": d / "grant",
            "dataplane_listen": f"127.0.0.1:{free_port()}",
            # With [network] the egress account must reach ``<socket_dir>-egress``
            # beside it, which a DIR of 0700 hides: the short one, in /tmp.
            "socket_dir": socket_dir(d, short=network is not None),
        },
        "storage": {"root": storage_root(d), "pool": pools},
        "resources": {"cpu": _number(cpu), "memory": memory},
    }
    if vmm_backend:
        doc["vmm"] = {"backend": vmm_backend}
        options = dict(vmm_options or {})
        if vmm_backend == "qemu":
            # A dev cluster's directory is wherever it was made (a home, a test's 0700
            # tmp), which the VMM account cannot traverse: its VMMs run as root, by an
            # explicit choice the node warns about at start.
            options = {"user": "root", **options}
        if options:  # ``[vmm.<backend>]``: e.g. the test VMM's ``write_records``
            doc["vmm"][vmm_backend] = options
    if network is not None:
        doc["network"] = dict(network)
    if test_inputs:
        doc["host"] = {"proc_root": layout.proc_root(node_id)}
        doc["testing"] = {"clock_skew_file": layout.clock_skew_file(node_id)}
    if testing:
        doc["testing"] = {**doc.get("testing", {}), **testing}
    path = layout.node_config(node_id)
    config.parse(config.NodeConfig, doc, str(path))  # bad input: nothing written
    for p in pools:
        # `kibotos-node storage-pool init --id … --path … --adopt`, as an operator does
        # before a node's first start: without the marker the node reports the pool
        # unavailable.  The shared pool's marker is written by the first node's call;
        # the others find it with the same ID (a no-op), so all report one `instance`.
        init_pool(p["id"], Path(p["path"]), adopt=True)
    (d / "root").mkdir(parents=True, exist_ok=True)
    link_storage_root(d)
    if test_inputs:
        atomicfile.write_bytes(layout.clock_skew_file(node_id), b"0\n")
        prepare_proc_root(layout.proc_root(node_id))
    write_config(path, config.NodeConfig, doc,
                 f"node {node_id} of a dev cluster, written by `kibotos dev cluster up`.")


#: A node's socket directory outside DIR (when DIR's path is too long); `down` removes it.
SHORT_SOCKET_DIR_PREFIX = "kibotos-dev-"


def socket_dir(node_dir: Path, *, short: bool = False) -> Path:
    """``<node dir>/run``, or a short directory under /tmp named by it when that path is
    too long for the unix sockets under it (sun_path holds 107 bytes) or `short` asks
    for it."""
    import hashlib
    import os
    import tempfile

    preferred = node_dir.absolute() / "run"
    if not short and len(os.fsencode(preferred)) + len("/dataplane/control.sock") <= 107:
        return preferred
    digest = hashlib.sha256(os.fsencode(preferred)).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"{SHORT_SOCKET_DIR_PREFIX}{digest}"


#: What the node and its VMMs add to the storage root for an Instance's sockets:
#: ``runtime/instances/<inst- + 26 characters>/agent-dp.sock`` (the longest name).
INSTANCE_SOCKET_TAIL = len("/runtime/instances/") + len("inst-") + 26 + len("/agent-dp.sock")


def storage_root(node_dir: Path) -> Path:
    """``<node dir>/root``, or, when the Instance sockets under it would not fit in
    sun_path (107 bytes: QEMU refuses to start), a short symbolic link to it under
    /tmp named by its path (`link_storage_root` makes it).  The files stay in DIR."""
    import hashlib
    import os
    import tempfile

    preferred = node_dir.absolute() / "root"
    if len(os.fsencode(preferred)) + INSTANCE_SOCKET_TAIL <= 107:
        return preferred
    digest = hashlib.sha256(os.fsencode(preferred)).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"{SHORT_SOCKET_DIR_PREFIX}{digest}-root"


def link_storage_root(node_dir: Path) -> None:
    """Point the short storage root (if this node uses one) at ``<node dir>/root``.
    The link outlives `down` (a node started again by hand needs it); a link left by a
    removed cluster at the same path is replaced."""
    import os

    target = node_dir.absolute() / "root"
    link = storage_root(node_dir)
    if link == target:
        return
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)


def _number(cpu: str) -> int | float | str:
    """``"4"`` -> 4, ``"2.5"`` -> 2.5; anything else stays a string for the validator."""
    try:
        value = float(cpu)
    except ValueError:
        return cpu
    return int(value) if value.is_integer() else value


def prepare_proc_root(target: Path, source: Path = Path("/proc")) -> None:
    """Copy the host-usage files a node reads from /proc into `target`, so a test can
    rewrite them (e.g. ``meminfo`` to make memory tight).

    ``self`` is a link to the real ``/proc/self``: the storage drivers read the mounts
    of the pools from ``<proc_root>/self/mounts``, and a dev cluster's pools are on this
    host's real mounts (a copy would go stale when mounts change)."""
    target.mkdir(parents=True, exist_ok=True)
    link = target / "self"
    if not link.is_symlink() and not link.exists():
        link.symlink_to(source / "self")
    for name in PROC_FILES:
        src = source / name
        dst = target / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = src.read_bytes()
        except OSError:
            continue  # e.g. no PSI on this kernel: the node shows '-' for it
        atomicfile.write_bytes(dst, data)


def write_meminfo(proc_root: Path, *, total_bytes: int, available_bytes: int) -> None:
    """Rewrite ``meminfo`` in a prepared proc tree with the given total and available
    memory, keeping its other lines."""
    path = proc_root / "meminfo"
    lines = path.read_text().splitlines() if path.exists() else []
    values = {"MemTotal": total_bytes // 1024, "MemAvailable": available_bytes // 1024}
    out, seen = [], set()
    for line in lines:
        key = line.split(":", 1)[0]
        if key in values:
            out.append(f"{key}:{values[key]:>16} kB")
            seen.add(key)
        else:
            out.append(line)
    out.extend(f"{k}:{v:>16} kB" for k, v in values.items() if k not in seen)
    atomicfile.write_bytes(path, ("\n".join(out) + "\n").encode())


def write_replica_config(layout: Layout, replica: int) -> Path:
    """ctrl replica `replica`'s config: replica 1's with a port of its own and a state
    directory holding copies of replica 1's shared keys (run after replica 1 started,
    which makes them)."""
    from kibotos.ctrl.replica import copy_shared_keys

    with open(layout.ctrl_config, "rb") as f:
        doc = tomllib.load(f)
    state = layout.replica_dir(replica) / "state"
    copy_shared_keys(layout.ctrl_state, state)
    doc["ctrl"].update(listen="127.0.0.1:0", state_dir=str(state))
    path = layout.replica_dir(replica) / "ctrl.toml"
    write_config(path, config.CtrlConfig, doc, CTRL_HEADER)
    return path
