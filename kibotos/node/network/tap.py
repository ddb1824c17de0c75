"""The guest's tap device, made and opened inside the Instance's namespace.

The tap is *persistent* (it outlives the file descriptors on it, so it exists before the
VMM starts and after it exits, until teardown removes it) and owned by the VMM account,
so a VMM that opens it by name in the namespace (QEMU's ``-netdev tap,ifname=``,
Firecracker's ``host_dev_name``) needs no capability (docs/network.md, "How the VMM
reaches its tap", says why by name rather than a descriptor passed by the node).
`open_tap` gives a descriptor attached to it, opened in the namespace (tests stand in
for the VMM with it).
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from pathlib import Path

from kibotos.node.network.netns import in_netns

TUN_DEVICE = "/dev/net/tun"
TUNSETIFF = 0x400454CA
TUNSETPERSIST = 0x400454CB
TUNSETOWNER = 0x400454CC
TUNSETGROUP = 0x400454CE
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
#: What QEMU's virtio-net wants: Ethernet frames, no packet-info prefix, and the
#: virtio-net header (so offloads can be negotiated).
TAP_FLAGS = IFF_TAP | IFF_NO_PI | IFF_VNET_HDR


def _attach(name: str) -> int:
    fd = os.open(TUN_DEVICE, os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), TAP_FLAGS))
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_tap(netns: Path, name: str, *, uid: int | None = None,
               gid: int | None = None) -> None:
    """Make the persistent tap `name` in `netns` (again: a no-op that re-sets the owner),
    owned by `uid`/`gid` when given."""

    def create() -> None:
        fd = _attach(name)
        try:
            if uid is not None:
                fcntl.ioctl(fd, TUNSETOWNER, uid)
            if gid is not None:
                fcntl.ioctl(fd, TUNSETGROUP, gid)
            fcntl.ioctl(fd, TUNSETPERSIST, 1)
        finally:
            os.close(fd)

    in_netns(netns, create)


def open_tap(netns: Path, name: str) -> int:
    """A descriptor on the existing tap `name` of `netns` (close-on-exec; the caller
    passes it on explicitly).  Raises OSError if the tap is not there."""

    def attach_existing() -> int:
        socket.if_nametoindex(name)  # OSError when absent: TUNSETIFF would make a new one
        return _attach(name)

    return in_netns(netns, attach_existing)
