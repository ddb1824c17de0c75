"""How the node runs egress processes: unit names, unit properties, the socket
directory, the generation counter and the release-line rule (spec: "Egress processes").

Units are ``kibotos-egress-<scope>-<generation>`` in ``kibotos-egress.slice``, with the
data plane's scope (`kibotos.node.dataplane.supervisor.scope_of`), ``Restart=no``,
``KillMode=control-group`` and no stop dependency on the node (a transient unit has
none).  They run as the system user ``kibotos-egress`` with no capabilities and no way
to gain any (``NoNewPrivileges=yes``, an empty ``CapabilityBoundingSet=``), a read-only
file system but their socket directory (``ProtectSystem=strict``,
``ReadWritePaths=``), and the node's storage root out of sight
(``InaccessiblePaths=``).  With the ``direct`` supervisor, which has no mount
namespaces, the file system properties are recorded only: there the account's lack of
rights keeps it out of the node's root-only directories.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
from pathlib import Path
from typing import Any

from kibotos.backends import Supervisor, UnitInfo
from kibotos.core.errors import FailedPrecondition
from kibotos.core.logs import EventLogger
from kibotos.node.dataplane.supervisor import scope_of
from kibotos.node.runtime.process_units import ProcessUnits

log = EventLogger()

UNIT_PREFIX = "kibotos-egress-"
SLICE = "kibotos-egress.slice"
GENERATION_FILE = "egress-generation"
USER = "kibotos-egress"


#: The egress units and generation counter (`kibotos.node.runtime.process_units`).
UNITS = ProcessUnits(UNIT_PREFIX, GENERATION_FILE, "egress")
unit_name = UNITS.unit_name
generation_of = UNITS.generation_of


def unit_properties(*, egress_dir: Path, storage_root: Path, user: str,
                    host_netns: Path | None) -> dict[str, Any]:
    properties: dict[str, Any] = {
        "Type": "exec", "Slice": SLICE, "Restart": "no", "KillMode": "control-group",
        "User": user, "NoNewPrivileges": True, "CapabilityBoundingSet": [],
        "AmbientCapabilities": [], "ProtectSystem": "strict",
        "ReadWritePaths": [str(egress_dir)], "InaccessiblePaths": [str(storage_root)],
    }
    if host_netns is not None:  # the host namespace the node's Instances are wired to
        properties["NetworkNamespacePath"] = str(host_netns)
    return properties


def account(user: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(user)
    except KeyError:
        raise FailedPrecondition(
            f"the system user {user} does not exist; the Debian package creates it, else: "
            f"useradd --system --user-group --no-create-home --home-dir /nonexistent "
            f"--shell /usr/sbin/nologin {user}") from None


def prepare_socket_dir(egress_dir: Path, owner: pwd.struct_passwd) -> None:
    """``<socket dir>-egress``: a directory (never a link), the account's, mode 0700."""
    egress_dir.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        egress_dir.mkdir(mode=0o700)
    info = os.lstat(egress_dir)
    if not stat.S_ISDIR(info.st_mode):
        raise FailedPrecondition(f"egress socket directory {egress_dir} is not a directory")
    if (info.st_uid, info.st_gid) != (owner.pw_uid, owner.pw_gid):
        os.chown(egress_dir, owner.pw_uid, owner.pw_gid, follow_symlinks=False)
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(egress_dir, 0o700)


async def list_units(supervisor: Supervisor, socket_dir: Path) -> list[UnitInfo]:
    """The node's egress units (running or not), oldest generation first."""
    return await UNITS.units(supervisor, scope_of(socket_dir))  # (it makes it absolute)


async def stop_units(supervisor: Supervisor, socket_dir: Path, *, timeout: float
                     ) -> list[str]:
    """End every egress process of the node; the units that were running."""
    return await UNITS.stop_all(supervisor, scope_of(socket_dir), timeout=timeout)
