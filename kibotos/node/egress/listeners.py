"""An Instance as the egress supervisor sees it, and the sockets the node opens for it
inside the Instance's network namespace.

The node opens them (`open_sockets`): the egress process cannot enter the namespace,
and a socket made by the node belongs to the node service's cgroup for as long as it
exists, so systemd's IP access rules of ``kibotos-node.service`` cover what the guest
sends through the egress process (spec: "Egress processes").  The node keeps no copy:
once handed over, a socket lives in the egress process only, so when that process dies
its sockets go with it and the guest's redirected connections are refused at once
(fail closed) until the next generation gets fresh ones.

A socket taken back from a generation for the next one is checked (`verify`): kind,
address and port, and the network namespace it lives in (``SIOCGSKNS``), so a
confused or compromised egress process cannot hand the next one anything else.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kibotos.core.errors import FailedPrecondition
from kibotos.egress.sockets import EGRESS_ROLES, ROLES, SIOCGSKNS, matches_role, roles_for
from kibotos.node.network import netns as ns
from kibotos.node.network.names import DNS_PORT, EGRESS_PORT, NETNS_DIR
from kibotos.node.network.policy import parse_policy
from kibotos.node.network.records import NetworkRecord
from kibotos.protocol.commands.network import EgressRef, ResolverRef

LISTEN_BACKLOG = 256


@dataclass(frozen=True)
class EgressInstance:
    """An Instance whose policy references an Egress or a Resolver."""

    instance_id: str
    netns: Path
    #: The gateway and guest address of each family (IPv4 first).
    gateways: tuple[str, ...]
    guests: tuple[str, ...]
    egress: EgressRef | None = None
    resolver: ResolverRef | None = None

    @classmethod
    def from_record(cls, record: NetworkRecord, *, netns_dir: Path = NETNS_DIR,
                    pending: bool = False) -> EgressInstance | None:
        """The Instance of a network record (its policy in force, or the one being
        switched to with `pending`); None when the policy references neither."""
        raw = record.pending_policy if pending and record.pending_policy else record.policy
        policy = parse_policy(raw)
        if policy.egress is None and policy.resolver is None:
            return None
        links = record.slot.families()
        return cls(instance_id=record.instance_id,
                   netns=record.names.netns_path(netns_dir),
                   gateways=tuple(str(link.gateway) for link in links),
                   guests=tuple(str(link.guest) for link in links),
                   egress=policy.egress, resolver=policy.resolver)

    @property
    def roles(self) -> list[str]:
        return roles_for(egress=self.egress is not None, resolver=self.resolver is not None,
                         v6=len(self.gateways) > 1)

    def address_of(self, role: str) -> tuple[str, int]:
        family = ROLES[role][0]
        gateway = next((g for g in self.gateways if (":" in g) == (family == socket.AF_INET6)),
                       None)
        if gateway is None:
            raise FailedPrecondition(f"Instance {self.instance_id} has no "
                                     f"{'IPv6' if family == socket.AF_INET6 else 'IPv4'} "
                                     f"gateway for its {role} socket")
        return gateway, EGRESS_PORT if role in EGRESS_ROLES else DNS_PORT


def _open_one(instance: EgressInstance, role: str) -> socket.socket:
    family, kind = ROLES[role]
    address = instance.address_of(role)
    sock = ns.socket_in(instance.netns, family, kind)
    try:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        if kind == socket.SOCK_STREAM:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        if kind == socket.SOCK_STREAM:
            sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise FailedPrecondition(f"open the {role} socket of Instance {instance.instance_id} "
                                 f"on {address[0]} port {address[1]} in {instance.netns}: "
                                 f"{exc.strerror or exc}") from None
    return sock


def open_sockets(instance: EgressInstance, roles: Iterable[str]) -> list[socket.socket]:
    """New sockets for `roles`, bound (and listening) in the Instance's namespace.
    Blocking (a short thread per socket): call it from a worker thread."""
    if not ns.is_netns(instance.netns):
        raise FailedPrecondition(f"Instance {instance.instance_id}: its network namespace "
                                 f"{instance.netns} is missing")
    opened: list[socket.socket] = []
    try:
        for role in roles:
            opened.append(_open_one(instance, role))
    except BaseException:
        for sock in opened:
            sock.close()
        raise
    return opened


def socket_netns_inode(sock: socket.socket) -> int:
    """The inode of the network namespace `sock` lives in."""
    fd = fcntl.ioctl(sock.fileno(), SIOCGSKNS, 0)
    try:
        return os.fstat(fd).st_ino
    finally:
        os.close(fd)


def verify(instance: EgressInstance, role: str, sock: socket.socket) -> str | None:
    """Why `sock` is not the `role` socket of `instance`, or None when it is."""
    if not matches_role(sock, role):
        return f"not a {role} socket"
    try:
        local = sock.getsockname()[:2]
        inode = socket_netns_inode(sock)
        expected = os.stat(instance.netns).st_ino
    except OSError as exc:
        return f"cannot inspect it: {exc.strerror or exc}"
    if tuple(local) != instance.address_of(role):
        return f"bound to {local}, not {instance.address_of(role)}"
    if inode != expected:
        return "it lives in another network namespace"
    if ROLES[role][1] == socket.SOCK_STREAM and \
            not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        return "it does not listen"
    return None


def close_all(socks: Iterable[socket.socket]) -> None:
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.close()
