"""The name of every network object of an Instance, derived from the node's scope and
the Instance ID alone.

Because nothing else goes into a name, a retry after a crash at any step of setup or
teardown finds what the interrupted attempt left, with or without a record on disk.
Inside the Instance's own namespace the names are fixed (the namespace is the
Instance's); in the host namespace, where every Instance and every node on the host
meets, the veth is ``kbv`` + 12 hex digits of a hash (an interface name holds at most
15 bytes, an Instance ID 32).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kibotos.core import ids
from kibotos.core.errors import InvalidArgument

#: Where named network namespaces live (``ip netns`` reads the same directory).
NETNS_DIR = Path("/run/netns")
NETNS_PREFIX = "kibotos-"
#: Host-side veth names: reserved for kibotos on a host (docs/network.md).
HOST_VETH_PREFIX = "kbv"
#: The guest's interface and the namespace's end of the veth, inside the namespace.
TAP = "tap0"
NS_VETH = "veth0"
#: The node's slot table in each Instance namespace.
TABLE_FAMILY = "inet"
TABLE = "kibotos"
#: Inside an Instance namespace with an Egress: the port of the egress process's
#: listener on the gateway address, where the slot table redirects the guest's TCP.
EGRESS_PORT = 15001
#: A Resolver's DNS sockets: the gateway's own port 53 (what the guest asks anyway).
DNS_PORT = 53

_SCOPE = re.compile(r"[0-9a-f]{8}")


@dataclass(frozen=True)
class NetworkNames:
    scope: str
    instance_id: str
    netns: str
    host_veth: str
    ns_veth: str = NS_VETH
    tap: str = TAP

    @classmethod
    def of(cls, scope: str, instance_id: str) -> NetworkNames:
        """The names for one Instance of the node whose processes are named `scope`
        (eight hex digits, `node_scope`)."""
        if not isinstance(scope, str) or not _SCOPE.fullmatch(scope):
            raise InvalidArgument(f"invalid network scope {scope!r}: expected 8 hex digits")
        ids.check_object_id(instance_id, "Instance ID")
        digest = hashlib.sha256(f"{scope}/{instance_id}".encode()).hexdigest()
        return cls(scope=scope, instance_id=instance_id,
                   netns=f"{NETNS_PREFIX}{scope}-{instance_id}",
                   host_veth=f"{HOST_VETH_PREFIX}{digest[:12]}")

    def netns_path(self, netns_dir: Path = NETNS_DIR) -> Path:
        return netns_dir / self.netns


def node_scope(socket_dir: Path) -> str:
    """Eight hex digits naming one node's processes and network objects on the host:
    derived from its socket directory, which several nodes on one host must not share
    (the data-plane units' scope, `kibotos.node.dataplane.supervisor.scope_of`)."""
    return hashlib.sha256(os.fsencode(os.path.abspath(socket_dir))).hexdigest()[:8]


def scope_netns_prefix(scope: str) -> str:
    """The prefix of the namespace names of one node (for listing its leftovers)."""
    return f"{NETNS_PREFIX}{scope}-"
