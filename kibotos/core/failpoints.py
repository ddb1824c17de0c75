"""Named failpoints: places where a crash must be survivable, made killable on purpose.

A failpoint is off unless the process was started with ``KIBOTOS_FAILPOINTS`` set, e.g.
``KIBOTOS_FAILPOINTS="record.before-rename=kill,launch.after-start=error"``.  Actions:

``kill``      SIGKILL this process at once (what a power cut or OOM kill looks like)
``error``     raise `FailpointError` (an I/O error the code must handle)
``sleep:S``   sleep S seconds (to widen a race window in a test)
``stop``      SIGSTOP this process (a test resumes it with SIGCONT)

An action may end in ``@N``: it then runs only at the N-th hit of that name in this
process (``atomic.before-rename=kill@2`` kills at the second atomic rename), so a test
can reach each write of a sequence that passes the same point several times.

The table is parsed once per process; with the variable unset, `hit()` is one dict
lookup on an empty dict.  Every name used in the code is listed in `KNOWN` so tests can
walk them and documentation can name them.
"""

from __future__ import annotations

import os
import signal
import time

ENV = "KIBOTOS_FAILPOINTS"

KNOWN: dict[str, str] = {
    "atomic.before-fsync": "an atomic file write, after the temporary file is written",
    "atomic.before-rename": "an atomic file write, after fsync and before the rename",
    "atomic.after-rename": "an atomic file write, after the rename and before the dir fsync",
    "ctrl.ca.after-key": "cluster CA creation, after the key is written and before the "
                         "certificate",
    "dataplane.handover.after-receive": "data-plane handover, in the new generation after it "
                                        "received and checked the listening socket and "
                                        "before it accepts on it",
    "dataplane.serve.after-control": "a data-plane process, after it bound control.sock "
                                     "and before it answers there (a handover's new "
                                     "generation has taken the path from the old one)",
    "node.incarnation.after-write": "node start, after the new incarnation is persisted",
    "node.enroll.after-exchange": "node enrollment, after ctrl issued the identity",
    "node.dataplane-cert.after-save": "data-plane certificate renewal, after the new "
                                      "certificate is saved and before the data plane has it",
    "node.instance.after-attachment-record": "Instance launch, after the attachment records "
                                             "are written and before the objects are opened",
    "node.instance.before-attachment-removal": "Instance stop, destroy or fencing, after an "
                                               "object's release is recorded and before its "
                                               "attachment record is removed",
    "node.instance.after-objects-open": "Instance launch, after the writable layer and Volumes "
                                        "are opened and before the launch record",
    "node.instance.after-launch-record": "Instance launch, after systemd.json is written and "
                                         "before the unit starts",
    "node.instance.after-unit-start": "Instance launch, after the VMM unit started and before "
                                      "its facts are recorded",
    "node.instance.after-network": "Instance launch, after the network (namespace, veth, tap, "
                                   "addresses, slot table) is made and before the Template "
                                   "is linked and the launch record written",
    "node.instance.before-network-teardown": "Instance stop or destroy, after the objects are "
                                             "released and before the network is removed",
    "node.instance.after-ready": "Instance launch, after the guest's hello and before RUNNING",
    "node.instance.before-stop": "Instance stop or destroy, before the VMM unit is stopped",
    "node.instance.after-stop": "Instance stop or destroy, after the VMM unit is gone",
    "node.instance.before-object-release": "Instance stop or destroy, before the writable layer "
                                           "and Volumes are released",
    "node.instance.after-object-release": "Instance stop or destroy, after the objects are "
                                          "released and before the Instance ends",
    "objects.take.after-holder": "pool object takeover, after this node's holder record is "
                                 "written and before the block file is opened",
    "objects.create.after-metadata": "pool object creation, after the metadata record and "
                                     "before the block file gets its name",
    "objects.create.after-data": "pool object creation, after the block file's rename and "
                                 "before the attach is recorded",
    "objects.release.after-metadata": "pool object release, after the clean release is "
                                      "recorded in the metadata and before the receipt",
    "objects.fence.before-receipt": "holder check, after the taken-over Instance's VMM is "
                                    "stopped and its block files flushed, before the receipt",
    "node.expand.after-check": "object.expand, after the first e2fsck",
    "node.expand.after-tune2fs": "object.expand, after resize_inode was removed, before the "
                                 "second e2fsck",
    "node.expand.after-recheck": "object.expand, after the e2fsck that follows tune2fs",
    "node.expand.after-grow-file": "object.expand, after the block file grew, before resize2fs",
    "node.expand.after-resize": "object.expand, after resize2fs, before the metadata records "
                                "the new capacity",
    "node.copy.before-rename": "object.copy, after the copy is fsynced, before its rename",
    "node.copy.after-data": "object.copy, after the target block file has its name, before "
                            "its metadata",
    "node.legacy-name.after-link": "renaming an object's old SHA-256 name, after the file is "
                                   "linked under its ID, before the old name is unlinked",
    "node.network.after-netns": "Instance network setup, after the namespace is bound",
    "node.network.after-veth": "Instance network setup, after the veth pair exists",
    "node.network.after-tap": "Instance network setup, after the guest's tap exists",
    "node.network.after-addresses": "Instance network setup, after addresses and routes",
    "node.network.after-table": "Instance network setup, after the slot table is written "
                                "and before the record has its facts",
    "node.network.after-egress": "Instance network setup with an Egress or Resolver, after "
                                 "the egress process serves the Instance (credentials on "
                                 "disk, sockets handed over) and before the VMM starts",
    "node.network.after-egress-release": "Instance network teardown, after the egress "
                                         "process let the Instance go and before its "
                                         "devices and namespace are removed",
    "node.network.switch.after-pending": "network switch, after the pending policy is "
                                         "recorded and before the table is written",
    "node.network.switch.after-table": "network switch, after the new table and before the "
                                       "record is updated",
    "node.network.teardown.after-devices": "Instance network teardown, after the tap and the "
                                           "veth are removed, before the namespace is unbound",
    "node.legacy-name.after-step": "renaming an object's old SHA-256 names, after one of its "
                                   "files moved, before the next (metadata moves last)",
}


class FailpointError(OSError):
    """Raised by a failpoint set to ``error``."""


def _parse(spec: str) -> dict[str, str]:
    table: dict[str, str] = {}
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, action = item.partition("=")
        table[name.strip()] = action.strip() if sep else "error"
    return table


_table: dict[str, str] = _parse(os.environ.get(ENV, ""))
_hits: dict[str, int] = {}


def reload() -> None:
    """Re-read the environment (tests that set the variable in-process call this)."""
    global _table
    _table = _parse(os.environ.get(ENV, ""))
    _hits.clear()


def hit(name: str) -> None:
    """Run the action configured for `name`, if any."""
    action = _table.get(name)
    if action is None:
        return
    action, at, nth = action.partition("@")
    if at:
        _hits[name] = _hits.get(name, 0) + 1
        if _hits[name] != int(nth):
            return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action.startswith("sleep:"):
        time.sleep(float(action.split(":", 1)[1]))
    else:
        raise FailpointError(f"failpoint {name} triggered")


def environment_for(prefix: str) -> dict[str, str]:
    """The variable for a child process the node starts in a unit of its own (the
    supervisor does not pass the node's environment on): the entries of this process's
    variable, read now, whose names start with `prefix` (``dataplane.``), so a test
    that starts a node with a data-plane failpoint reaches the data-plane process."""
    items = [f"{name}={action}" for name, action in _parse(os.environ.get(ENV, "")).items()
             if name.startswith(prefix)]
    return {ENV: ",".join(items)} if items else {}
