"""An Instance's network objects: its namespace, the veth pair to the host, the guest's
tap, their addresses and routes; made before the VMM starts, removed after it ended.

Both directions are idempotent and safe to repeat after a crash at any step: every
object's name comes from the scope and Instance ID (`names.NetworkNames`), each step
accepts finding its object already there, and teardown removes whatever exists and
nothing else.  The caller writes the network record before `setup` and removes it after
`teardown` (`records.NetworkRecords`), so a crash between them leaves a record that
says what to remove.  The slot table is written separately (`slot_table.apply`).

Inside the namespace::

    guest (VM) ── tap0 ─┤ namespace: forwards, filters, NATs ├─ veth0 ══ kbv… ── host

The namespace's default route is the host end of the veth; the host needs no route
per Instance (the namespace masquerades the guest to its veth address) and nothing
but the veth, so a host carries nothing of an Instance once the veth is gone.
"""

from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyroute2.netlink.exceptions import NetlinkError

from kibotos.core import failpoints
from kibotos.core.errors import FailedPrecondition
from kibotos.node.network import netns as ns
from kibotos.node.network.names import (
    HOST_VETH_PREFIX,
    NETNS_DIR,
    NetworkNames,
    scope_netns_prefix,
)
from kibotos.node.network.records import NetworkRecord
from kibotos.node.network.slots import LinkAddresses
from kibotos.node.network.tap import create_tap

IFA_F_NODAD = 0x02  # an address of ours on a point-to-point link needs no duplicate test
#: The interface group of the tap and the veth in the namespace: one RTM_DELLINK of the
#: group removes both (and the veth's host end) in one batch, one RCU grace period
#: instead of one per device (~15 ms each).
DEVICE_GROUP = 0x6B69


def _sysctls(v6: bool) -> dict[str, str]:
    values = {"net.ipv4.ip_forward": "1",
              "net.ipv4.conf.all.rp_filter": "1", "net.ipv4.conf.default.rp_filter": "1",
              "net.ipv4.conf.all.accept_redirects": "0",
              "net.ipv4.conf.default.accept_redirects": "0",
              "net.ipv4.conf.all.send_redirects": "0",
              "net.ipv4.conf.default.send_redirects": "0"}
    if not v6:  # no link-local addresses either: nothing IPv6 in the namespace
        return {**values, "net.ipv6.conf.all.disable_ipv6": "1",
                "net.ipv6.conf.default.disable_ipv6": "1"}
    return {**values, "net.ipv6.conf.all.forwarding": "1",
            "net.ipv6.conf.all.accept_ra": "0", "net.ipv6.conf.default.accept_ra": "0",
            "net.ipv6.conf.all.autoconf": "0", "net.ipv6.conf.default.autoconf": "0",
            "net.ipv6.conf.all.accept_redirects": "0",
            "net.ipv6.conf.default.accept_redirects": "0"}


def _index(ipr: Any, name: str) -> int | None:
    found = ipr.link_lookup(ifname=name)
    return int(found[0]) if found else None


def _add_address(ipr: Any, index: int, address: Any, prefix: int) -> None:
    family = socket.AF_INET if address.version == 4 else socket.AF_INET6
    flags = {} if address.version == 4 else {"flags": IFA_F_NODAD}
    try:
        ipr.addr("add", index=index, address=str(address), prefixlen=prefix, family=family,
                 **flags)
    except NetlinkError as exc:
        if exc.code != errno.EEXIST:
            raise


def _veth(names: NetworkNames, path: Path, host: Path | None) -> None:
    with ns.netlink(host) as ipr:
        if _index(ipr, names.host_veth) is not None:
            return
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:  # one message: the peer is born inside the namespace, never in the host
            ipr.link("add", ifname=names.host_veth, kind="veth",
                     peer={"ifname": names.ns_veth, "net_ns_fd": fd})
        finally:
            os.close(fd)


def _addresses(record: NetworkRecord, path: Path, host: Path | None) -> None:
    names, families = record.names, record.slot.families()
    with ns.netlink(host) as ipr:
        index = _index(ipr, names.host_veth)
        if index is None:
            raise FailedPrecondition(f"host veth {names.host_veth} vanished during setup")
        for link in families:
            _add_address(ipr, index, link.host, link.prefix)
        ipr.link("set", index=index, state="up")
    with ns.netlink(path) as ipr:
        ipr.link("set", index=_index(ipr, "lo"), state="up")
        veth, tap = _index(ipr, names.ns_veth), _index(ipr, names.tap)
        if veth is None or tap is None:
            raise FailedPrecondition(f"{names.ns_veth} or {names.tap} missing in {path}")
        for link in families:
            _add_address(ipr, veth, link.ns, link.prefix)
            _add_address(ipr, tap, link.gateway, link.prefix)
        ipr.link("set", index=veth, state="up", group=DEVICE_GROUP)
        ipr.link("set", index=tap, state="up", group=DEVICE_GROUP)
        for link in families:
            _default_route(ipr, veth, link)


def _default_route(ipr: Any, veth: int, link: LinkAddresses) -> None:
    family = socket.AF_INET if link.host.version == 4 else socket.AF_INET6
    ipr.route("replace", dst="default", gateway=str(link.host), oif=veth, family=family)


def setup(record: NetworkRecord, *, host_netns: Path | None = None,
          netns_dir: Path = NETNS_DIR, tap_uid: int | None = None,
          tap_gid: int | None = None) -> Path:
    """Make (or finish making) the Instance's network; returns its namespace path.
    `host_netns` is the namespace the veth's other end goes to (None: the node's)."""
    names = record.names
    path = names.netns_path(netns_dir)
    with ns.map_netlink_errors(f"create network namespace {path}"):
        ns.create_netns(path)
    failpoints.hit("node.network.after-netns")
    with ns.map_netlink_errors(f"configure network namespace {path}"):
        ns.write_sysctls(path, _sysctls(record.slot.v6 is not None))
    with ns.map_netlink_errors(f"create veth {names.host_veth}"):
        _veth(names, path, host_netns)
    failpoints.hit("node.network.after-veth")
    with ns.map_netlink_errors(f"create tap {names.tap} in {path}"):
        create_tap(path, names.tap, uid=tap_uid, gid=tap_gid)
    failpoints.hit("node.network.after-tap")
    with ns.map_netlink_errors(f"address the network of {names.instance_id}"):
        _addresses(record, path, host_netns)
    failpoints.hit("node.network.after-addresses")
    return path


def teardown(names: NetworkNames, *, host_netns: Path | None = None,
             netns_dir: Path = NETNS_DIR) -> list[str]:
    """Remove every network object of the Instance that exists; what it removed.  The
    tap and the veth go explicitly, not only with the namespace: a descriptor still
    open on the tap would keep the namespace, and so both, alive."""
    path = names.netns_path(netns_dir)
    removed = []
    if ns.is_netns(path):
        with ns.map_netlink_errors(f"remove the devices of {path}"), ns.netlink(path) as ipr:
            present = [n for n in (names.tap, names.ns_veth) if _index(ipr, n) is not None]
            if present:
                _delete(ipr, group=DEVICE_GROUP)
                for name in present:  # a setup killed before the group was set
                    index = _index(ipr, name)
                    if index is not None:
                        _delete(ipr, index=index)
                removed += [f"{name} in {names.netns}" for name in present]
        if removed:
            failpoints.hit("node.network.teardown.after-devices")
    with ns.map_netlink_errors(f"remove veth {names.host_veth}"), ns.netlink(host_netns) as ipr:
        index = _index(ipr, names.host_veth)
        if index is not None:
            _delete(ipr, index=index)
            removed.append(names.host_veth)
    with ns.map_netlink_errors(f"remove network namespace {path}"):
        if ns.remove_netns(path):
            removed.append(str(path))
    return removed


def _delete(ipr: Any, **which: int) -> None:
    try:
        ipr.link("del", **which)
    except NetlinkError as exc:
        if exc.code != errno.ENODEV:  # gone meanwhile (the peer of a veth just deleted)
            raise


# ---------------------------------------------------------------------------- inspection


@dataclass(frozen=True)
class Present:
    """Which of an Instance's network objects exist (for checks and tests)."""

    netns: bool
    host_veth: bool
    ns_devices: tuple[str, ...]
    host_addresses: tuple[str, ...]

    @property
    def anything(self) -> bool:
        return bool(self.netns or self.host_veth or self.ns_devices or self.host_addresses)


def present(record: NetworkRecord, *, host_netns: Path | None = None,
            netns_dir: Path = NETNS_DIR) -> Present:
    names = record.names
    path = names.netns_path(netns_dir)
    devices: tuple[str, ...] = ()
    if ns.is_netns(path):
        with ns.netlink(path) as ipr:
            devices = tuple(n for n in (names.tap, names.ns_veth) if _index(ipr, n) is not None)
    slot_addresses = {str(a) for link in record.slot.families()
                      for a in (link.host, link.ns, link.gateway, link.guest)}
    with ns.netlink(host_netns) as ipr:
        veth = _index(ipr, names.host_veth) is not None
        found = tuple(sorted(a.get_attr("IFA_ADDRESS") for a in ipr.get_addr()
                             if a.get_attr("IFA_ADDRESS") in slot_addresses))
    return Present(netns=path.exists(), host_veth=veth, ns_devices=devices,
                   host_addresses=found)


def host_veths(host_netns: Path | None = None) -> list[str]:
    """The kibotos veths in the host namespace (of every node on the host)."""
    with ns.netlink(host_netns) as ipr:
        return sorted(n for link in ipr.get_links()
                      if (n := link.get_attr("IFLA_IFNAME")).startswith(HOST_VETH_PREFIX))


def node_namespaces(scope: str, netns_dir: Path = NETNS_DIR) -> list[str]:
    """The names of the namespaces this node's Instances have (leftovers included)."""
    prefix = scope_netns_prefix(scope)
    try:
        return sorted(n for n in os.listdir(netns_dir) if n.startswith(prefix))
    except FileNotFoundError:
        return []
