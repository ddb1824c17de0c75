"""The fixed subdirectories of a pool, their owner and mode, and block-file ownership.

spec/storage-pools-on-nfs.txt, "Directory layout" and "Prerequisites": the node creates
``volumes/`` and ``retained-layers/`` (and their fixed subdirectories) inside an existing
pool directory and changes the two top directories to ``root:kibotos-vmm`` 0710, so the
VMM account can reach its block files but not list them; block files are
``root:kibotos-vmm`` 0660 so the VMM can open them for writing.  The pool directory
itself is the operator's: the node never creates it (an absent one usually means the
export is not mounted yet) and never changes its owner or mode.

On an export with ``root_squash`` the ``chown`` fails; that error names the step ("hand
… to the VMM identity") because it is what the spec tells operators to look for.
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

from kibotos.core.errors import FailedPrecondition

# The VMM group and the handing of paths to it live with the host layout (one place
# for the storage root and the pools); re-exported for the pools' code.
from kibotos.node.host.vmm_access import VMM_GROUP as VMM_GROUP
from kibotos.node.host.vmm_access import set_owner as _set_owner
from kibotos.node.host.vmm_access import vmm_gid as vmm_gid

VOLUMES = "volumes"
RETAINED_LAYERS = "retained-layers"
#: Every directory the node keeps in a pool, by kind (spec: "Directory layout").
SUBDIRS: dict[str, tuple[str, ...]] = {
    VOLUMES: ("data", "metadata", "holders", "releases", "locks", "transfer-staging"),
    RETAINED_LAYERS: ("data", "metadata", "holders", "releases", "locks"),
}
TOP_MODE = 0o710
#: ``data/`` holds the block files the VMM opens: it must be traversable by the VMM
#: group; the record directories are the node's alone.
DATA_MODE = 0o710
RECORD_MODE = 0o700
BLOCK_FILE_MODE = 0o660
_LABEL = {VOLUMES: "raw Volume", RETAINED_LAYERS: "retained layer"}


def prepare_pool_dirs(pool_id: str, pool_path: Path, *, group: str = VMM_GROUP) -> None:
    """Create the node's directories in the existing pool directory `pool_path`.

    The message for a missing pool directory is the one the spec's troubleshooting table
    tells operators to look for (``prepare host layout: create …/volumes``)."""
    gid = vmm_gid(group) if os.geteuid() == 0 else os.getegid()
    for kind, subs in SUBDIRS.items():
        top = pool_path / kind
        if not pool_path.is_dir():
            raise FailedPrecondition(
                f"prepare host layout: create {top}: pool directory {pool_path} of pool "
                f"{pool_id!r} does not exist (not mounted yet, or not created with mkdir "
                "or `kibotos-node storage-pool init`)")
        try:
            top.mkdir(mode=TOP_MODE, exist_ok=True)
            for sub in subs:
                (top / sub).mkdir(mode=RECORD_MODE, exist_ok=True)
        except OSError as exc:
            raise FailedPrecondition(
                f"prepare host layout: create {exc.filename or top}: {exc.strerror}"
            ) from None
        _set_owner(top, gid, TOP_MODE, f"prepare host layout: hand {top} to the VMM identity")
        _set_owner(top / "data", gid, DATA_MODE,
                   f"prepare host layout: hand {top / 'data'} to the VMM identity")


def check_traversable(pool_id: str, pool_path: Path, *, group: str = VMM_GROUP) -> None:
    """Refuse to start when the VMM identity cannot traverse the pool directory itself.

    spec/storage-pools-on-nfs.txt, "Prerequisites" and "Troubleshooting": the node
    manages only the subdirectories, so an operator who mounted the export (or made the
    directory 0700) must ``chown root:kibotos-vmm`` and ``chmod 0710`` it; without that
    every VMM fails to open its block files later, far from the cause.  Traversable
    means search permission for the group ``kibotos-vmm`` (as others, as the group when
    the directory has that group, or as the owner when a ``kibotos-vmm`` user owns it).
    """
    gid = vmm_gid(group) if os.geteuid() == 0 else os.getegid()
    try:
        vmm_uid: int | None = pwd.getpwnam(group).pw_uid
    except KeyError:
        vmm_uid = None
    st = os.stat(pool_path)
    mode = stat.S_IMODE(st.st_mode)
    if (mode & stat.S_IXOTH or (st.st_gid == gid and mode & stat.S_IXGRP)
            or (vmm_uid is not None and st.st_uid == vmm_uid and mode & stat.S_IXUSR)):
        return
    raise FailedPrecondition(
        f"prepare host layout: pool directory {pool_path} of pool {pool_id!r} is not "
        f"traversable by VMM identity (group {group}, gid {gid}): it is owned by "
        f"{st.st_uid}:{st.st_gid} with mode {mode:04o}; the node does not change the pool "
        f"directory itself: run `chown root:{group} {pool_path}` and "
        f"`chmod 0710 {pool_path}`", details={"reason": "pool_not_traversable",
                                              "pool_id": pool_id, "path": str(pool_path)})


def hand_block_file(path: Path, kind: str, *, group: str = VMM_GROUP) -> None:
    """Make a new block file ``root:kibotos-vmm`` 0660 so the VMM can write it.

    Called by the objects code right after it creates a block file.  Fails with the
    spec's wording (``hand raw Volume to the VMM identity`` / ``hand retained layer to
    the VMM identity``) when the export squashes root."""
    label = _LABEL.get(kind, kind)
    gid = vmm_gid(group) if os.geteuid() == 0 else os.getegid()
    _set_owner(path, gid, BLOCK_FILE_MODE, f"hand {label} to the VMM identity")
