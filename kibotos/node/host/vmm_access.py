"""The VMM identity's group, and handing the node's directories to it.

VMMs run as the non-root account ``kibotos-vmm`` (spec: node-and-vmm-processes, "VMM
service": the qemu backend's unit runs directly as it, with the supplementary group
``kvm``; Firecracker's jailer switches to it).  Such a VMM opens its block files in the
pools (``root:kibotos-vmm``, `kibotos.node.storage.pools.dirs`) and, in its Instance
directory under the storage root, the Template image and kernel the node linked there,
and it creates its sockets and logs there.  So the path to an Instance directory is
handed to the group: the storage root, ``runtime/`` and ``runtime/instances/`` are
``root:kibotos-vmm`` 0710 (traverse, not list), and each Instance directory is
``root:kibotos-vmm`` 1770: the VMM may create files in it, and the sticky bit keeps it
from removing or renaming the node's own records there (0600, root's).  Everything
else under the storage root stays root's, 0700.

Handing costs nothing when a VMM runs as root (the operator's explicit choice), so the
node always does it.  Not as root (tests, a developer's node) only the modes are set.
"""

from __future__ import annotations

import grp
import os
import subprocess
from pathlib import Path

from kibotos.core.errors import FailedPrecondition

VMM_GROUP = "kibotos-vmm"
#: The storage root, runtime/, runtime/instances/: the VMM group may pass, not list.
TRAVERSE_MODE = 0o710
#: An Instance directory: the VMM group creates its sockets and logs; sticky, so it
#: cannot remove or replace the node's records.
INSTANCE_DIR_MODE = 0o1770


def vmm_gid(group: str = VMM_GROUP) -> int:
    """The VMM group's ID, creating the group (``groupadd --system``) if missing."""
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        pass
    try:
        proc = subprocess.run(["groupadd", "--system", group], capture_output=True,
                              text=True, check=False, timeout=60)
    except OSError as exc:
        raise FailedPrecondition(f"create group {group}: groupadd: {exc.strerror or exc}"
                                 ) from None
    # 9: the group exists (another process created it meanwhile)
    if proc.returncode not in (0, 9):
        raise FailedPrecondition(f"create group {group}: groupadd --system failed: "
                                 f"{proc.stderr.strip() or proc.returncode}")
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise FailedPrecondition(f"group {group} still missing after groupadd") from None


def group_id() -> int:
    """The group to hand directories to: the VMM group as root, else our own."""
    return vmm_gid() if os.geteuid() == 0 else os.getegid()


def set_owner(path: Path, gid: int, mode: int, step: str) -> None:
    """chown root:<gid> (as root) then chmod, unless already so (a shared pool is
    prepared by every node; rewriting the same values costs a round trip on NFS each).
    `step` names what failed in the error (the spec's troubleshooting wording)."""
    st = os.lstat(path)
    try:
        if os.geteuid() == 0 and (st.st_uid != 0 or st.st_gid != gid):
            os.chown(path, 0, gid, follow_symlinks=False)
        if st.st_mode & 0o7777 != mode:
            os.chmod(path, mode)
    except OSError as exc:
        raise FailedPrecondition(
            f"{step}: chown root:{gid} / chmod {mode:o} {path}: {exc.strerror or exc} "
            "(an export with root_squash refuses this: use no_root_squash)") from None


def hand_path_to_instances(root: Path) -> None:
    """The storage root, ``runtime/`` and ``runtime/instances/`` (created if missing)
    traversable by the VMM group."""
    instances = root / "runtime" / "instances"
    instances.mkdir(mode=0o700, parents=True, exist_ok=True)
    gid = group_id()
    for path in (root, root / "runtime", instances):
        set_owner(path, gid, TRAVERSE_MODE,
                  f"prepare host layout: hand {path} to the VMM identity")


def make_instance_dir(root: Path, path: Path) -> None:
    """A new Instance directory `path` under the storage root `root` that the VMM can
    work in (see the module docstring)."""
    hand_path_to_instances(root)
    path.mkdir(mode=0o700)
    set_owner(path, group_id(), INSTANCE_DIR_MODE,
              f"create Instance directory: hand {path} to the VMM identity")
