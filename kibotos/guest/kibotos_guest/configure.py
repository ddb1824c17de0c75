"""``configure``: hostname, environment defaults, the network interface, DNS, Volumes and
retained file systems.

Everything is validated before anything is written, and every step compares first, so
an identical second ``configure`` changes nothing (docs/guest-protocol.md).  Files are
written atomically; mounts and file writes run in a worker thread, so a stuck disk
never stops the agent answering.
"""

from __future__ import annotations

import json
import os
import re
import stat

from .errors import AgentError, field, guest_path, invalid
from .runtime.sysio import MS_RDONLY, atomic_write, mount_at, read_text, sys_mount
from .runtime.tasks import run_in_thread
from .services.processes import env_key_ok

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .core import Agent

FS_TYPES = ("ext4",)
_HOSTNAME = re.compile(r"(?=.{1,64}$)[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*")
_DNS_WORD = re.compile(r"[A-Za-z0-9_.:-]{1,253}")
_MOUNT_OPTIONS = re.compile(r"[A-Za-z0-9_=,.:/-]*")
_HOSTS_MARK = "# kibotos-guest"
_FIELDS = {"hostname", "env", "dns", "volumes", "retained_filesystems", "network"}
_MAC = re.compile(r"[0-9a-f]{2}(:[0-9a-f]{2}){5}")


def parse_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The validated configuration; raises invalid_argument before anything is done."""
    unknown = sorted(set(cfg) - _FIELDS)
    if unknown:
        raise invalid(f"configure: unknown field(s) {', '.join(unknown)}")
    out: dict[str, Any] = {}
    if cfg.get("hostname") is not None:
        if not isinstance(cfg["hostname"], str) or not _HOSTNAME.fullmatch(cfg["hostname"]):
            raise invalid(f"configure: invalid hostname {cfg['hostname']!r}")
        out["hostname"] = cfg["hostname"]
    if cfg.get("env") is not None:
        env = cfg["env"]
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and env_key_ok(k) and isinstance(v, str) and "\0" not in v
            for k, v in env.items()
        ):
            raise invalid("configure: 'env' must map variable names to strings")
        out["env"] = dict(sorted(env.items()))
    if cfg.get("dns") is not None:
        out["dns"] = _parse_dns(cfg["dns"])
    if cfg.get("network") is not None:
        out["network"] = _parse_network(cfg["network"])
    if cfg.get("volumes") is not None:
        out["volumes"] = _parse_volumes(cfg["volumes"])
    if cfg.get("retained_filesystems") is not None:
        if not isinstance(cfg["retained_filesystems"], list):
            raise invalid("configure: 'retained_filesystems' must be a list of paths")
        out["retained_filesystems"] = [guest_path(p, "configure: retained filesystem")
                                       for p in cfg["retained_filesystems"]]
    return out


def _parse_dns(dns: Any) -> dict[str, list[str]]:
    import ipaddress

    if not isinstance(dns, dict) or set(dns) - {"nameservers", "search", "options"}:
        raise invalid("configure: 'dns' takes nameservers, search and options")
    out: dict[str, list[str]] = {}
    for key, limit in (("nameservers", 3), ("search", 6), ("options", 16)):
        values = dns.get(key) or []
        if not isinstance(values, list) or len(values) > limit or not all(
            isinstance(v, str) and _DNS_WORD.fullmatch(v) for v in values
        ):
            raise invalid(f"configure: dns {key} must be a list of at most {limit} words")
        out[key] = list(values)
    for ns in out["nameservers"]:
        try:
            ipaddress.ip_address(ns)
        except ValueError:
            raise invalid(f"configure: dns nameserver {ns!r} is not an IP address") from None
    return out


def _parse_network(net: Any) -> dict[str, Any]:
    """``{mac, addresses: [{family, address, prefix, gateway}]}``, one address (and so
    one default route) per family at most."""
    import ipaddress

    if not isinstance(net, dict) or set(net) - {"mac", "addresses"}:
        raise invalid("configure: 'network' takes mac and addresses")
    mac = net.get("mac")
    if not isinstance(mac, str) or not _MAC.fullmatch(mac):
        raise invalid(f"configure: network mac {mac!r} is not a MAC like 02:00:00:00:00:01")
    addresses = net.get("addresses") or []
    if not isinstance(addresses, list):
        raise invalid("configure: network addresses must be a list")
    out, families = [], set()
    for entry in addresses:
        if not isinstance(entry, dict) or set(entry) != {"family", "address", "prefix",
                                                         "gateway"}:
            raise invalid("configure: each network address has exactly family, address, "
                          "prefix and gateway")
        family, prefix = entry["family"], entry["prefix"]
        version = {"ipv4": 4, "ipv6": 6}.get(family)
        if version is None or family in families:
            raise invalid(f"configure: network family {family!r} must be ipv4 or ipv6, "
                          "each at most once")
        families.add(family)
        try:
            address = ipaddress.ip_address(entry["address"])
            gateway = ipaddress.ip_address(entry["gateway"])
        except (TypeError, ValueError):
            raise invalid(f"configure: network address {entry['address']!r} or gateway "
                          f"{entry['gateway']!r} is not an IP address") from None
        bits = 32 if version == 4 else 128
        if address.version != version or gateway.version != version or \
                isinstance(prefix, bool) or not isinstance(prefix, int) or \
                not 1 <= prefix <= bits:
            raise invalid(f"configure: network address {address}/{prefix} via {gateway} "
                          f"is not a valid {family} address")
        out.append({"family": family, "address": str(address), "prefix": prefix,
                    "gateway": str(gateway)})
    return {"mac": mac, "addresses": out}


def _parse_volumes(volumes: Any) -> list[dict[str, Any]]:
    if not isinstance(volumes, list):
        raise invalid("configure: 'volumes' must be a list")
    out: list[dict[str, Any]] = []
    for vol in volumes:
        if not isinstance(vol, dict):
            raise invalid("configure: each volume must be an object")
        vol = {"type": "configure volume", **vol}
        device = guest_path(field(vol, "device", str), "configure: volume device")
        mount_point = guest_path(field(vol, "mount_point", str), "configure: mount point")
        fs_type = field(vol, "fs_type", str, "ext4")
        options = field(vol, "options", str, "")
        if mount_point == "/" or fs_type not in FS_TYPES:
            raise invalid(f"configure: volume {mount_point} needs a mount point other than"
                          f" / and a file system type among {', '.join(FS_TYPES)}")
        if not _MOUNT_OPTIONS.fullmatch(options):
            raise invalid(f"configure: invalid mount options {options!r}")
        try:
            is_block = stat.S_ISBLK(os.stat(device).st_mode)
        except OSError:
            is_block = False
        if not is_block:
            raise invalid(f"configure: volume device {device} is not a block device here")
        out.append({"device": device, "mount_point": mount_point, "fs_type": fs_type,
                    "options": options, "read_only": field(vol, "read_only", bool, False),
                    "retained": field(vol, "retained", bool, True)})
    points = [v["mount_point"] for v in out]
    if len(set(points)) != len(points):
        raise invalid("configure: two volumes share a mount point")
    return out


def _sha256_hex(data: bytes) -> str:
    """hashlib loads OpenSSL's libcrypto: tens of milliseconds in a TCG guest, on the
    boot's critical path (configure follows the hello).  CPython's own SHA-256 module
    (``_sha256``, up to Python 3.11: Debian 12's) gives the same digest for far less."""
    try:
        from _sha256 import sha256  # type: ignore[import-not-found]
    except ImportError:  # Python 3.12 renamed it; hashlib then
        from hashlib import sha256
    return str(sha256(data).hexdigest())


async def configure_request(agent: Agent, msg: dict[str, Any]) -> dict[str, Any]:
    parsed = parse_config(field(msg, "config", dict))
    async with agent.config_lock:
        actions: list[str] = []
        try:
            # A mount may hang on a stuck disk, so with Volumes the work goes to a
            # thread; without, it is a few small files on the root, where a thread (and
            # importing threading: ~40 ms in a TCG guest) buys nothing.
            if parsed.get("volumes"):
                await run_in_thread(_apply_config, agent, parsed, actions)
            else:
                _apply_config(agent, parsed, actions)
        except AgentError as e:
            raise AgentError(e.code, e.message, {"actions": actions}) from None
        except OSError as e:
            raise AgentError("internal", f"configure: {e}", {"actions": actions}) from None
        if "env" in parsed and parsed["env"] != agent.env_defaults:
            agent.env_defaults = parsed["env"]
            actions.append(f"set {len(parsed['env'])} environment default(s)")
        old_retained = agent.config.get("retained_filesystems")
        if parsed.get("retained_filesystems", old_retained) != old_retained:
            actions.append("set retained file systems")
        agent.config = {**agent.config, **parsed}
        canonical = json.dumps(agent.config, sort_keys=True, separators=(",", ":"))
        agent.config_digest = "sha256:" + _sha256_hex(canonical.encode())
    return {"changed": bool(actions), "actions": actions, "config_digest": agent.config_digest}


def retained(agent: Agent) -> list[str]:
    """The file systems stop_prepare syncs and freezes by default."""
    vols = [v["mount_point"] for v in agent.config.get("volumes", []) if v["retained"]]
    return sorted(set(agent.config.get("retained_filesystems", [])) | set(vols))


def _apply_config(agent: Agent, cfg: dict[str, Any], actions: list[str]) -> None:
    if "hostname" in cfg:
        _apply_hostname(agent, cfg["hostname"], actions)
    if "network" in cfg:
        from .services.netconf import apply

        apply(cfg["network"], actions)
    if "dns" in cfg:
        dns = cfg["dns"]
        text = "# written by kibotos-guest\n" + "".join(
            f"nameserver {ns}\n" for ns in dns["nameservers"])
        text += f"search {' '.join(dns['search'])}\n" if dns["search"] else ""
        text += f"options {' '.join(dns['options'])}\n" if dns["options"] else ""
        path = agent.path("/etc/resolv.conf")
        if os.path.islink(path) or read_text(path) != text:
            atomic_write(path, text.encode(), durable=False)
            actions.append("wrote /etc/resolv.conf")
    for vol in cfg.get("volumes", []):
        _apply_volume(agent, vol, actions)


def _apply_hostname(agent: Agent, name: str, actions: list[str]) -> None:
    # /proc/sys/kernel/hostname is sethostname(2) without importing socket (~0.1 s in
    # a TCG guest, on the boot's critical path).
    if agent.root == "/" and os.uname().nodename != name:
        with open("/proc/sys/kernel/hostname", "w") as f:
            f.write(name)
        actions.append(f"set hostname {name}")
    path = agent.path("/etc/hostname")
    if read_text(path) != name + "\n":
        atomic_write(path, (name + "\n").encode(), durable=False)
        actions.append("wrote /etc/hostname")
    path = agent.path("/etc/hosts")
    old = read_text(path)
    lines = (old or "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")
    rows = lines.splitlines()
    ours = f"127.0.1.1\t{name}\t{_HOSTS_MARK}"
    marked = [i for i, row in enumerate(rows) if row.endswith(_HOSTS_MARK)]
    if marked:
        rows[marked[0]] = ours
        rows = [r for i, r in enumerate(rows) if i not in marked[1:]]
    else:
        rows.append(ours)
    new = "\n".join(rows) + "\n"
    if new != old:
        atomic_write(path, new.encode(), durable=False)
        actions.append("wrote /etc/hosts")


def _apply_volume(agent: Agent, vol: dict[str, Any], actions: list[str]) -> None:
    target = agent.path(vol["mount_point"])
    rdev = os.stat(vol["device"]).st_rdev
    entry = mount_at(os.path.realpath(target))
    if entry is not None:
        if entry.dev == (os.major(rdev), os.minor(rdev)):
            return  # already there: configure is idempotent
        raise AgentError("failed_precondition", f"configure: {vol['mount_point']} already "
                         f"has {entry.source} ({entry.fs_type}) mounted")
    os.makedirs(target, mode=0o755, exist_ok=True)
    try:
        sys_mount(vol["device"], os.path.realpath(target), vol["fs_type"],
                  MS_RDONLY if vol["read_only"] else 0, vol["options"])
    except OSError as e:
        raise AgentError("failed_precondition", f"configure: mounting {vol['device']} on "
                         f"{vol['mount_point']} failed: {e.strerror}") from None
    actions.append(f"mounted {vol['device']} on {vol['mount_point']} ({vol['fs_type']})")
