"""Runs a VMM command with a helper in its process group that stays stuck in the
kernel: the ``stuckvmm`` backend's unit program (tests only, standard library only).

    python stuckvmm_wrapper.py --stuck PATH -- ARGV...

Forks a child that looks up PATH (a name on a FUSE file system that never answers,
``tests/node/stuck_fuse.py``), so the child waits in the kernel like a VMM thread
waiting on a storage mount that stopped answering, then execs ARGV in place: ARGV's
process is the unit's main process, the child a member of its process group that
SIGKILL does not end until the file system answers.
"""

from __future__ import annotations

import contextlib
import os
import sys


def main() -> None:
    args = sys.argv[1:]
    if len(args) < 4 or args[0] != "--stuck" or args[2] != "--":
        sys.exit("usage: stuckvmm_wrapper.py --stuck PATH -- ARGV...")
    path, argv = args[1], args[3:]
    if os.fork() == 0:
        with contextlib.suppress(OSError):
            os.stat(path)
        os._exit(0)
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main()
