"""The "VM" of the ``testvmm`` backend: prepares a guest root, then becomes the agent.

Standard library only: it is the main program of a unit the supervisor starts with an
empty environment.  It execs the real guest agent (`kibotos/guest/agent.py`) in place,
so the unit's MainPID *is* the agent and everything the node does with a guest (hello,
configure, exec, stop_prepare, sync) runs for real, without QEMU.

    python3 testvmm_guest.py --agent AGENT --socket SOCK --root DIR [--hang] [--refuse]

``--hang`` never starts the agent (a guest that does not come up: the readiness wait
times out); ``--refuse`` starts it announcing protocol version 0, outside what the
host accepts.

The data plane's agent socket, ``agent-dp.sock`` beside the agent's socket, is a symlink
to it: with ``--socket`` the agent serves every connection as its own session, which is
what the second virtio port (``org.kibotos.agent.1``) gives the data plane in a real VM.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--agent", required=True)
    p.add_argument("--socket", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--hang", action="store_true")
    p.add_argument("--refuse", action="store_true")
    args = p.parse_args()
    for sub in ("etc", "run", "tmp"):
        os.makedirs(os.path.join(args.root, sub), exist_ok=True)
    print(f"testvmm: guest root {args.root}, agent socket {args.socket}", flush=True)
    dataplane = os.path.join(os.path.dirname(args.socket), "agent-dp.sock")
    if not os.path.lexists(dataplane):
        os.symlink(os.path.basename(args.socket), dataplane)
    if args.hang:
        while True:
            signal.pause()
    argv = [sys.executable, args.agent, "--socket", args.socket, "--root", args.root]
    if args.refuse:
        argv.append("--advertise-protocol-version=0")
    os.execv(sys.executable, argv)


if __name__ == "__main__":
    main()
