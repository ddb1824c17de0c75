"""The launcher: starts one unit detached from the node, records it, and exits.

Run by the node as ``python -m kibotos_direct.launch`` with a JSON request on stdin.
The unit must not be the node's child: a node that restarts has to find (adopt) its
units, and a child would die with or be reaped by the node.  So the node starts this
short-lived launcher; the launcher starts the unit in a new session (its own process
group, ``setsid``) and exits, and the unit is reparented to init (or the nearest
subreaper).  While the launcher is still the parent, even a unit that exited at once
stays a zombie, so its start time can always be read.

The launcher writes the unit's state record itself, atomically, before it reports
back: if the node dies in the middle of a start, the record of the started process is
on disk anyway and the next node finds it.  It prints the record (or ``{"error": …}``
for a command that could not be executed) as one JSON line on stdout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from kibotos.sdk import atomicfile, procfs
from kibotos_direct import confine


def _reset_signals() -> None:
    """Give the unit default signal dispositions and an empty mask: an ignored SIGTERM
    or a blocked signal inherited from the node would survive exec and make the unit
    deaf to `stop`."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            continue
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def identity(pid: int, proc: Path = procfs.PROC) -> dict[str, object]:
    """Every identity fact of `pid` as the unit record keeps it (None where unreadable):
    what `describe` later compares to tell the unit from a process that reused its PID."""
    stat = procfs.read_stat(pid, proc)
    exe = procfs.executable(pid, proc)
    return {
        "main_pid": pid,
        "start_time_ticks": stat.start_time_ticks if stat else None,
        "executable": exe[0] if exe else None,
        "executable_dev_ino": list(exe[1]) if exe else None,
        "cgroup": procfs.cgroup(pid, proc),
        "netns_inode": procfs.netns_inode(pid, proc),
        "boot_id": procfs.boot_id(proc),
    }


def launch(request: dict[str, Any]) -> dict[str, Any]:
    log_path = Path(request["log_path"])
    log_path.parent.mkdir(parents=True, exist_ok=True)
    _reset_signals()
    try:
        confinement = confine.plan(request["properties"])
    except ValueError as exc:
        return {"error": f"unit property: {exc}"}
    if confinement.netns is not None:
        # checked here, before the fork: an error in `confine.apply` reaches us only as
        # "Exception occurred in preexec_fn", which names nothing
        try:
            confine.check_netns(confinement.netns)
        except OSError as exc:
            return {"error": f"NetworkNamespacePath={confinement.netns}: "
                             f"{exc.strerror or exc}"}
    with open(log_path, "ab") as log:
        try:
            proc = subprocess.Popen(
                request["argv"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd=request["cwd"],
                env=request["env"],
                start_new_session=True,
                close_fds=True,
                # the launcher is single-threaded, so a pre-exec function is safe here
                preexec_fn=lambda: confine.apply(confinement),
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
    record: dict[str, Any] = {
        "name": request["name"],
        "argv": request["argv"],
        "invocation_id": request["invocation_id"],
        "log_path": str(log_path),
        "properties": request["properties"],
        "working_directory": request["cwd"],
        "process_group": proc.pid,
        **identity(proc.pid),
    }
    atomicfile.write_json(Path(request["record_path"]), record)
    return record


def main() -> None:
    request = json.loads(sys.stdin.read())
    result = launch(request)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    # Leave without waiting for the unit: it must outlive us.  os._exit skips the
    # Popen finaliser, which would otherwise warn that the child still runs.
    os._exit(0)


if __name__ == "__main__":
    main()
