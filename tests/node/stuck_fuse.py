"""A FUSE file system that never answers: a real uninterruptible wait for the stuck
VMM tests (spec: a VMM stuck on storage survives SIGKILL until the storage answers).

    python stuck_fuse.py MOUNTPOINT

Mounts an empty FUSE file system at MOUNTPOINT (needs root and /dev/fuse), answers the
kernel's INIT, then reads every request and answers none: a process that looks up a
name there waits in the kernel, and once its request has been read, not even SIGKILL
ends that wait.  It prints ``ready`` once mounted and ``held <opcode>`` for each request
it holds.  A line ``release`` on stdin answers every held request (and every later one)
with ENOENT, which frees the waiting processes; stdin's end does the same, then the
file system is unmounted and the program exits.  Closing /dev/fuse (this process
dying) aborts the connection, which frees them too.

Standard library only; the protocol structs are those of <linux/fuse.h>.
"""

from __future__ import annotations

import errno
import os
import select
import struct
import subprocess
import sys

FUSE_INIT = 26
FUSE_FORGET = 2
FUSE_INTERRUPT = 36
FUSE_BATCH_FORGET = 42
NO_REPLY = {FUSE_FORGET, FUSE_INTERRUPT, FUSE_BATCH_FORGET}
IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid extlen pad
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
READ_SIZE = 1 << 17 | 4096


def _reply(fd: int, unique: int, error: int = 0, body: bytes = b"") -> None:
    os.write(fd, OUT_HEADER.pack(OUT_HEADER.size + len(body), error, unique) + body)


def main() -> None:
    mountpoint = sys.argv[1]
    fd = os.open("/dev/fuse", os.O_RDWR)
    subprocess.run(["mount", "-t", "fuse.kibotos-stuck", "-o",
                    f"fd={fd},rootmode=40000,user_id=0,group_id=0", "kibotos-stuck",
                    mountpoint], pass_fds=[fd], check=True)
    print("ready", flush=True)
    held: list[int] = []
    releasing = False
    try:
        while True:
            readable, _, _ = select.select([fd, sys.stdin], [], [])
            if sys.stdin in readable:
                line = sys.stdin.readline()
                if line.strip() == "release" or not line:
                    releasing = True
                    for unique in held:
                        _reply(fd, unique, -errno.ENOENT)
                    held.clear()
                    print("released", flush=True)
                    if not line:
                        return
            if fd in readable:
                try:
                    data = os.read(fd, READ_SIZE)
                except OSError as exc:
                    if exc.errno in (errno.ENOENT, errno.EINTR, errno.EAGAIN):
                        continue
                    return  # ENODEV: unmounted
                _len, opcode, unique, *_ = IN_HEADER.unpack_from(data)
                if opcode == FUSE_INIT:
                    # major 7, minor 19, max_readahead, flags, max_background,
                    # congestion_threshold, max_write (the 7.19 reply layout)
                    _reply(fd, unique, 0, struct.pack("<IIIIHHI", 7, 19, 0, 0, 16, 12,
                                                      1 << 17))
                elif opcode in NO_REPLY:
                    continue
                elif releasing:
                    _reply(fd, unique, -errno.ENOENT)
                else:
                    held.append(unique)
                    print(f"held {opcode}", flush=True)
    finally:
        subprocess.run(["umount", "-l", mountpoint], check=False)
        os.close(fd)


if __name__ == "__main__":
    main()
