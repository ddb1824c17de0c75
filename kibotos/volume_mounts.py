"""Where the guest mounts a Volume: the mount-point rules shared by ctrl (which checks
``kibo workspace create --volume VOL:MOUNTPOINT`` and sends ``mount_point`` in
``instance.create``), the CLI (which checks before sending) and the node.

A mount point is an absolute, normalised guest path of at most 1024 bytes, without
control characters, backslashes, ':' or ',' (they would break the guest's mount
table or the ``VOL:MOUNTPOINT`` syntax), and not a guest system directory, which a
Volume would hide.  Without one, a Volume is mounted at ``/mnt/<volume_id>``.
"""

from __future__ import annotations

from kibotos.core.errors import InvalidArgument

MAX_MOUNT_POINT = 1024
#: Guest paths a Volume must never hide: the guest's own system directories.
RESERVED_MOUNTS = frozenset({"/", "/bin", "/boot", "/dev", "/etc", "/lib", "/lib64",
                             "/proc", "/run", "/sbin", "/sys", "/usr", "/var"})


def check_mount_point(value: object) -> str:
    """The mount point as given, or `InvalidArgument` naming what is wrong."""
    if not isinstance(value, str) or not value.startswith("/"):
        raise InvalidArgument(f"mount point {value!r} must be an absolute guest path")
    if len(value.encode()) > MAX_MOUNT_POINT:
        raise InvalidArgument(f"mount point must be at most {MAX_MOUNT_POINT} bytes")
    if any(ord(c) < 0x20 or c in "\\:," for c in value):
        raise InvalidArgument(f"mount point {value!r} contains a control character, "
                              "a backslash, ':' or ','")
    parts = value.split("/")[1:]
    if value != "/" and ("" in parts or "." in parts or ".." in parts):
        raise InvalidArgument(f"mount point {value!r} must be normalised (no '//', '.', "
                              "'..' or trailing '/')")
    if value in RESERVED_MOUNTS:
        raise InvalidArgument(f"mount point {value!r} would hide a guest system directory")
    return value


def default_mount_point(volume_id: str) -> str:
    return f"/mnt/{volume_id}"
