"""The guest's network interface, configured over rtnetlink: a raw ``AF_NETLINK``
socket and `struct`, because a Template carries no ``ip`` binary and the agent uses
the standard library only.  Loaded by ``configure`` when it has a ``network`` field,
never before the first hello.

Every function works in the calling process's network namespace (in a VM: the guest's
only one; under the test VMM: the stand-in guest's), reads before it writes, and
reports what it changed, so a second identical ``configure`` changes nothing.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

NETLINK_ROUTE = 0
RTM_NEWLINK, RTM_GETLINK = 16, 18
RTM_NEWADDR, RTM_DELADDR, RTM_GETADDR = 20, 21, 22
RTM_NEWROUTE, RTM_GETROUTE = 24, 26
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_ACK, NLM_F_DUMP = 0x1, 0x4, 0x300
NLM_F_REPLACE, NLM_F_EXCL, NLM_F_CREATE = 0x100, 0x200, 0x400
IFLA_ADDRESS, IFLA_IFNAME = 1, 3
IFA_ADDRESS, IFA_LOCAL, IFA_FLAGS = 1, 2, 8
IFA_F_NODAD, IFA_F_PERMANENT = 0x02, 0x80
RTA_DST, RTA_OIF, RTA_GATEWAY, RTA_TABLE = 1, 4, 5, 15
RT_TABLE_MAIN, RTPROT_STATIC, RTN_UNICAST = 254, 4, 1
RT_SCOPE_UNIVERSE, RT_SCOPE_LINK = 0, 253
IFF_UP = 0x1

_HEADER = struct.Struct("=IHHII")  # nlmsghdr
_IFINFO = struct.Struct("=BxHiII")  # ifinfomsg
_IFADDR = struct.Struct("=BBBBI")  # ifaddrmsg
_RTMSG = struct.Struct("=BBBBBBBBI")  # rtmsg
_ATTR = struct.Struct("=HH")  # rtattr


def _attr(kind: int, value: bytes) -> bytes:
    data = _ATTR.pack(_ATTR.size + len(value), kind) + value
    return data + b"\0" * (-len(data) % 4)


def _attrs(data: bytes) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    while len(data) >= _ATTR.size:
        length, kind = _ATTR.unpack_from(data)
        if length < _ATTR.size:
            break
        out[kind & 0x3FFF] = data[_ATTR.size:length]
        data = data[(length + 3) & ~3:]
    return out


def _family(family: str) -> int:
    return socket.AF_INET if family == "ipv4" else socket.AF_INET6


class Netlink:
    """One rtnetlink socket; requests are answered in order (one at a time)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                                  NETLINK_ROUTE)
        self.sock.bind((0, 0))
        self.seq = 0

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Netlink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, kind: int, flags: int, body: bytes) -> list[tuple[int, bytes]]:
        """Send one request; the messages of its answer (a dump's parts), raising
        OSError for a netlink error."""
        self.seq += 1
        seq = self.seq
        self.sock.send(_HEADER.pack(_HEADER.size + len(body), kind,
                                    flags | NLM_F_REQUEST, seq, 0) + body)
        found: list[tuple[int, bytes]] = []
        while True:
            data = self.sock.recv(1 << 16)
            while len(data) >= _HEADER.size:
                length, mtype, _, mseq, _ = _HEADER.unpack_from(data)
                payload, data = data[_HEADER.size:length], data[(length + 3) & ~3:]
                if mseq != seq:
                    continue
                if mtype == NLMSG_ERROR:
                    (code,) = struct.unpack_from("=i", payload)
                    if code:
                        raise OSError(-code, os.strerror(-code))
                    return found  # the ACK
                if mtype == NLMSG_DONE:
                    return found
                found.append((mtype, payload))
                if not flags & NLM_F_DUMP and not flags & NLM_F_ACK:
                    return found

    # ------------------------------------------------------------------ links

    def links(self) -> list[tuple[int, str, str, int]]:
        """``(index, name, mac, flags)`` of every interface."""
        out = []
        for _, payload in self._request(RTM_GETLINK, NLM_F_DUMP,
                                        _IFINFO.pack(socket.AF_UNSPEC, 0, 0, 0, 0)):
            _, _, index, flags, _ = _IFINFO.unpack_from(payload)
            attrs = _attrs(payload[_IFINFO.size:])
            name = attrs.get(IFLA_IFNAME, b"").rstrip(b"\0").decode()
            mac = ":".join(f"{b:02x}" for b in attrs.get(IFLA_ADDRESS, b""))
            out.append((index, name, mac, flags))
        return out

    def set_up(self, index: int) -> None:
        self._request(RTM_NEWLINK, NLM_F_ACK,
                      _IFINFO.pack(socket.AF_UNSPEC, 0, index, IFF_UP, IFF_UP))

    # ------------------------------------------------------------------ addresses

    def addresses(self, index: int) -> set[tuple[str, str, int]]:
        """``(family, address, prefix)`` of the interface's global addresses."""
        out = set()
        for _, payload in self._request(RTM_GETADDR, NLM_F_DUMP,
                                        _IFADDR.pack(socket.AF_UNSPEC, 0, 0, 0, 0)):
            family, prefix, _, scope, ifindex = _IFADDR.unpack_from(payload)
            if ifindex != index or scope != RT_SCOPE_UNIVERSE:
                continue
            attrs = _attrs(payload[_IFADDR.size:])
            raw = attrs.get(IFA_LOCAL) or attrs.get(IFA_ADDRESS)
            if raw is None:
                continue
            name = "ipv4" if family == socket.AF_INET else "ipv6"
            out.add((name, str(ipaddress.ip_address(raw)), prefix))
        return out

    def _address(self, kind: int, flags: int, index: int, family: str, address: str,
                 prefix: int) -> None:
        raw = ipaddress.ip_address(address).packed
        ifa_flags = IFA_F_PERMANENT | (IFA_F_NODAD if family == "ipv6" else 0)
        body = _IFADDR.pack(_family(family), prefix, ifa_flags & 0xFF, RT_SCOPE_UNIVERSE,
                            index)
        body += _attr(IFA_LOCAL, raw) + _attr(IFA_ADDRESS, raw)
        body += _attr(IFA_FLAGS, struct.pack("=I", ifa_flags))
        self._request(kind, flags | NLM_F_ACK, body)

    def add_address(self, index: int, family: str, address: str, prefix: int) -> None:
        """The address, with no duplicate detection (the link is point-to-point and
        the address the node's: usable at once)."""
        self._address(RTM_NEWADDR, NLM_F_CREATE | NLM_F_REPLACE, index, family, address,
                      prefix)

    def delete_address(self, index: int, family: str, address: str, prefix: int) -> None:
        self._address(RTM_DELADDR, 0, index, family, address, prefix)

    # ------------------------------------------------------------------ routes

    def default_route(self, family: str) -> tuple[str, int] | None:
        """``(gateway, interface index)`` of the main table's default route."""
        body = _RTMSG.pack(_family(family), 0, 0, 0, 0, 0, 0, 0, 0)
        for _, payload in self._request(RTM_GETROUTE, NLM_F_DUMP, body):
            _, dst_len, _, _, table, _, _, rtype, _ = _RTMSG.unpack_from(payload)
            attrs = _attrs(payload[_RTMSG.size:])
            table = struct.unpack("=I", attrs[RTA_TABLE])[0] if RTA_TABLE in attrs else table
            if dst_len or table != RT_TABLE_MAIN or rtype != RTN_UNICAST:
                continue
            gateway, oif = attrs.get(RTA_GATEWAY), attrs.get(RTA_OIF)
            if gateway is not None and oif is not None:
                return str(ipaddress.ip_address(gateway)), struct.unpack("=i", oif)[0]
        return None

    def set_default_route(self, family: str, gateway: str, index: int) -> None:
        body = _RTMSG.pack(_family(family), 0, 0, 0, RT_TABLE_MAIN, RTPROT_STATIC,
                           RT_SCOPE_UNIVERSE, RTN_UNICAST, 0)
        body += _attr(RTA_GATEWAY, ipaddress.ip_address(gateway).packed)
        body += _attr(RTA_OIF, struct.pack("=i", index))
        self._request(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_REPLACE | NLM_F_ACK, body)


def find_link(nl: Netlink, mac: str) -> tuple[int, str, int] | None:
    for index, name, found, flags in nl.links():
        if found == mac:
            return index, name, flags
    return None


def apply(network: dict[str, Any], actions: list[str], wait_s: float = 10.0) -> None:
    """Bring ``lo`` and the interface with the configured MAC up, make its global
    addresses exactly the configured ones, and set a default route per family via its
    gateway.  The interface may appear a moment after the guest's virtio-net driver
    loaded: it is waited for up to `wait_s` seconds."""
    import time

    from ..errors import AgentError

    with Netlink() as nl:
        deadline = time.monotonic() + wait_s
        while (link := find_link(nl, network["mac"])) is None:
            if time.monotonic() > deadline:
                raise AgentError("failed_precondition", "configure: no network interface "
                                 f"has MAC {network['mac']}")
            time.sleep(0.05)
        index, name, flags = link
        for lo_index, lo_name, _, lo_flags in nl.links():
            if lo_name == "lo" and not lo_flags & IFF_UP:
                nl.set_up(lo_index)
                actions.append("brought lo up")
        if not flags & IFF_UP:
            nl.set_up(index)
            actions.append(f"brought {name} up")
        wanted = {(a["family"], a["address"], a["prefix"]) for a in network["addresses"]}
        have = nl.addresses(index)
        for family, address, prefix in sorted(have - wanted):
            nl.delete_address(index, family, address, prefix)
            actions.append(f"removed {address}/{prefix} from {name}")
        for family, address, prefix in sorted(wanted - have):
            nl.add_address(index, family, address, prefix)
            actions.append(f"added {address}/{prefix} to {name}")
        for entry in network["addresses"]:
            if nl.default_route(entry["family"]) != (entry["gateway"], index):
                nl.set_default_route(entry["family"], entry["gateway"], index)
                actions.append(f"set the default route via {entry['gateway']} on {name}")
