"""The "VM" of the ``testvmm`` backend: prepares a guest root, then becomes the agent.

Standard library only: it is the main program of a unit the supervisor starts with an
empty environment.  It execs the real guest agent (`kibotos/guest/agent.py`) in place,
so the unit's MainPID *is* the agent and everything the node does with a guest (hello,
configure, exec, stop_prepare, sync) runs for real, without QEMU.

    python3 testvmm_guest.py --agent AGENT --socket SOCK --root DIR [--hang] [--refuse]
                             [--write BLOCKFILE --tag TAG]... [--tap NAME --mac MAC]

``--hang`` never starts the agent (a guest that does not come up: the readiness wait
times out); ``--refuse`` starts it announcing protocol version 0, outside what the
host accepts.

``--write`` (the backend's ``write_records`` option, one per writable disk) forks a
writer before the agent starts, in the unit's process group, so it ends with the unit
like a VMM's I/O thread: it appends fixed-size records ``<tag> <seq> <unix time>`` to
the block file's record region (`RECORDS_AT`, continuing after the last record found
there), each made durable with fdatasync, every `WRITE_INTERVAL` s until killed.
`read_records` reads them back: the fencing tests check that no write of an old holder
lands after the new holder opened.

``--tap`` (a launch with a network) gives the "VM" a NIC as QEMU does: the unit runs in
the Instance's namespace (the supervisor joined it), where it opens the node's tap by
name; it makes a network namespace for the guest with a tap ``eth0`` carrying the
guest's MAC, starts the agent there as its child (which dies with it), and itself stays
in the Instance's namespace as the unit's main process, copying frames between the two
descriptors (both carry the virtio-net header), like QEMU; it ends when the agent ends.
So the agent's ``configure`` finds ``eth0`` by MAC, and what it executes reaches the
network only through the Instance's tap.

The data plane's agent socket, ``agent-dp.sock`` beside the agent's socket, is a symlink
to it: with ``--socket`` the agent serves every connection as its own session, which is
what the second virtio port (``org.kibotos.agent.1``) gives the data plane in a real VM.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import sys
import time

#: Where the record region starts in the block file, and its slot size and length.
RECORDS_AT = 1 << 20
RECORD = 64
SLOTS = 16384
WRITE_INTERVAL = 0.02


def read_stamped(path: str) -> list[tuple[str, int, float]]:
    """The (tag, seq, unix time) records in `path`'s region, up to the first slot that
    holds none (all zero, or whatever the file system had there)."""
    out = []
    with open(path, "rb") as f:
        f.seek(RECORDS_AT)
        region = f.read(RECORD * SLOTS)
    for i in range(0, len(region) - RECORD + 1, RECORD):
        try:
            tag, seq, stamp = region[i:i + RECORD].decode().split()
            out.append((tag, int(seq), float(stamp)))
        except ValueError:  # also UnicodeDecodeError
            break
    return out


def read_records(path: str) -> list[tuple[str, int]]:
    """The (tag, seq) records in `path`'s region (`read_stamped`)."""
    return [(tag, seq) for tag, seq, _ in read_stamped(path)]


def _write_forever(paths: list[str], tag: str) -> None:
    fds = [os.open(p, os.O_RDWR) for p in paths]
    slots = [len(read_records(p)) for p in paths]
    seq = 0
    while True:
        for i, fd in enumerate(fds):
            if slots[i] >= SLOTS:
                continue
            rec = f"{tag} {seq} {time.time():.6f}".encode().ljust(RECORD - 1) + b"\n"
            os.pwrite(fd, rec, RECORDS_AT + slots[i] * RECORD)
            os.fdatasync(fd)
            slots[i] += 1
        seq += 1
        time.sleep(WRITE_INTERVAL)


def _start_writer(paths: list[str], tag: str) -> None:
    if os.fork() != 0:
        return
    try:  # die with the "VM" even if the process group is not signalled
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        _write_forever(paths, tag)
    finally:
        os._exit(1)


TUNSETIFF = 0x400454CA
SIOCSIFHWADDR = 0x8924
IFF_TAP, IFF_NO_PI, IFF_VNET_HDR = 0x0002, 0x1000, 0x4000
CLONE_NEWNET = 0x40000000
GUEST_NIC = "eth0"


def _tap(name: str) -> int:
    import fcntl
    import struct

    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(),
                                           IFF_TAP | IFF_NO_PI | IFF_VNET_HDR))
    return fd


def _guest_nic(tap: str, mac: str) -> tuple[int, int, int]:
    """Open the Instance's tap here, make the guest's namespace and its NIC there (see
    the module docstring); ``(tap fd, NIC fd, guest namespace fd)``.  This process
    stays in the Instance's namespace, as QEMU does."""
    import fcntl
    import socket
    import struct

    socket.if_nametoindex(tap)  # OSError when absent: TUNSETIFF would make a new one
    outer = _tap(tap)
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    if libc.unshare(CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")
    guest_ns = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    inner = _tap(GUEST_NIC)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        fcntl.ioctl(sock, SIOCSIFHWADDR, struct.pack("16sH6s8x", GUEST_NIC.encode(), 1,
                                                     bytes.fromhex(mac.replace(":", ""))))
    if libc.setns(home, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns back to the Instance's namespace")
    os.close(home)
    return outer, inner, guest_ns


def _run_vm(argv: list[str], tap: str, mac: str) -> None:
    """The "VMM" with a NIC: the agent in the guest's namespace as a child that dies
    with this process; this process relays frames until the agent ends, then ends too
    (as QEMU does when its guest powers off)."""
    import select

    outer, inner, guest_ns = _guest_nic(tap, mac)
    libc = ctypes.CDLL(None, use_errno=True)
    child = os.fork()
    if child == 0:
        try:
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with the "VMM"
            if libc.setns(guest_ns, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns into the guest's namespace")
            os.execv(argv[0], argv)
        finally:
            os._exit(1)
    os.close(guest_ns)
    while True:
        for fd in select.select([outer, inner], [], [], 0.5)[0]:
            frame = os.read(fd, 65536 + 64)
            # the other side not up yet (EIO): the frame is lost, as on a wire
            with contextlib.suppress(OSError):
                os.write(inner if fd == outer else outer, frame)
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--agent", required=True)
    p.add_argument("--socket", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--hang", action="store_true")
    p.add_argument("--refuse", action="store_true")
    p.add_argument("--write", action="append", default=[])
    p.add_argument("--tag", default="vm")
    p.add_argument("--tap")
    p.add_argument("--mac")
    args = p.parse_args()
    for sub in ("etc", "run", "tmp"):
        os.makedirs(os.path.join(args.root, sub), exist_ok=True)
    print(f"testvmm: guest root {args.root}, agent socket {args.socket}", flush=True)
    dataplane = os.path.join(os.path.dirname(args.socket), "agent-dp.sock")
    if not os.path.lexists(dataplane):
        os.symlink(os.path.basename(args.socket), dataplane)
    if args.write:
        _start_writer(args.write, args.tag)
    if args.hang:
        while True:
            signal.pause()
    argv = [sys.executable, args.agent, "--socket", args.socket, "--root", args.root]
    if args.refuse:
        argv.append("--advertise-protocol-version=0")
    if args.tap:
        _run_vm(argv, args.tap, args.mac)
    os.execv(sys.executable, argv)


if __name__ == "__main__":
    main()
