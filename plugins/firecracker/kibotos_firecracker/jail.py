"""The jail of one microVM: its layout, the jailer's command line, and the files in it.

The jailer (docs/jailer.md in Firecracker's repository) builds
``<chroot_base>/<exec_file_name>/<id>/root``, copies Firecracker in, pivots into it,
drops to ``--uid``/``--gid`` and execs Firecracker, which from then on sees only that
directory.  Every file the microVM needs must therefore be *inside* it before the jailer
starts; the jailer leaves an existing directory alone.  `stage` puts them there:

* **hard link** when the file is on the sandbox root's file system: no copy, no mount,
  and the guest writes straight into the pool file;
* **bind mount** otherwise (the spec keeps the shared sandbox root on a tmpfs, so across
  file systems is the usual case): the jailer binds the jail recursively (``MS_REC``)
  before ``pivot_root``, so a file mounted there is what Firecracker opens.  Read-only
  files get a read-only bind.

Never a copy: a copied writable layer or Volume would take the guest's writes away from
the pool file, and a copied kernel or Template costs its size in RAM on a tmpfs.

Instance-owned files (the writable layer and Volumes) are handed to the VMM account
(``chown``), which must open them itself; shared ones (kernel, initramfs, Template
image) must already be readable by it, since changing the owner of a cached blob would
change it for every Instance that links it.

Firecracker gives each virtio disk the serial ``<st_dev><st_rdev><st_ino>`` of its
backing file, cut to 20 bytes; a hard link or bind mount keeps device and inode, so the
host knows in advance what the guest will see (`guest_serial`) and tells the Platform
init by ``kibotos.root=``/``kibotos.rw=`` on the kernel command line.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import socket
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kibotos.sdk import FailedPrecondition, procfs
from kibotos_firecracker.launch import Launch

#: Paths as Firecracker sees them inside the jail.
API_SOCKET = "/run/firecracker.socket"
VSOCK_SOCKET = "/run/agent.vsock"
KERNEL = "/vmlinux"
INITRAMFS = "/initramfs"
#: The longest unix socket path the kernel takes (sun_path is 108 bytes with the NUL).
MAX_SOCKET_PATH = 107
#: virtio-blk's serial field (VIRTIO_BLK_ID_BYTES).
SERIAL_BYTES = 20

_MS_RDONLY = 1
_MS_REMOUNT = 32
_MS_BIND = 4096
_MNT_DETACH = 2


@dataclass(frozen=True)
class JailFile:
    """One file the microVM uses: where it comes from and its place in the jail."""

    source: Path
    jail_path: str
    writable: bool
    #: Instance-owned (writable layer, Volume): handed to the VMM account.
    owned: bool
    #: The Firecracker drive ID (letters, digits, '_'), or None for kernel/initramfs.
    drive_id: str | None = None


@dataclass(frozen=True)
class Jail:
    """Where the jailer puts one microVM: ``<base>/<exec_name>/<jail_id>/root``."""

    base_dir: Path
    exec_name: str
    jail_id: str

    @property
    def instance_dir(self) -> Path:
        return self.base_dir / self.exec_name / self.jail_id

    @property
    def root(self) -> Path:
        return self.instance_dir / "root"

    def host_path(self, jail_path: str) -> Path:
        """The host path of `jail_path` (absolute inside the jail)."""
        return self.root / jail_path.lstrip("/")

    @property
    def api_socket(self) -> Path:
        return self.host_path(API_SOCKET)

    @property
    def vsock_socket(self) -> Path:
        return self.host_path(VSOCK_SOCKET)


def jail_files(launch: Launch) -> list[JailFile]:
    """Kernel, initramfs, Template (drive ``root``), writable layer (``rw``), Volumes
    (``vol0``…), in the order they are attached.  Drive IDs avoid '-': Firecracker
    takes only letters, digits and '_' in API resource IDs."""
    files = [
        JailFile(launch.vmlinux, KERNEL, writable=False, owned=False),
        JailFile(launch.initramfs, INITRAMFS, writable=False, owned=False),
        JailFile(launch.template_image, "/rootfs.img", writable=False, owned=False,
                 drive_id="root"),
        JailFile(launch.writable_layer, "/rw.img", writable=True, owned=True,
                 drive_id="rw"),
    ]
    for i, vol in enumerate(launch.volumes):
        files.append(JailFile(vol.path, f"/vol{i}.img", writable=not vol.read_only,
                              owned=True, drive_id=f"vol{i}"))
    return files


def slice_cgroup(slice_name: str) -> str:
    """The cgroup path of a systemd slice: ``a-b.slice`` is ``a.slice/a-b.slice``."""
    stem = slice_name.removesuffix(".slice")
    parts = stem.split("-")
    return "/".join("-".join(parts[:i + 1]) + ".slice" for i in range(len(parts)))


def jailer_argv(*, jailer: str, firecracker: str, jail: Jail, uid: int, gid: int,
                unit_cgroup: str, netns: Path | None) -> list[str]:
    """The unit's command: the jailer, its flags, then Firecracker's after ``--``.

    ``--cgroup-version 2`` with no ``--cgroup``: the jailer then creates no cgroup; it
    only moves itself into ``--parent-cgroup`` if that exists, and this names the unit's
    own cgroup, so the process stays where systemd put it (the spec: the jailer no
    longer creates other cgroups or moves processes into them).  No ``--daemonize`` or
    ``--new-pid-ns``: both fork and let the first process exit, which would end a
    ``Type=exec`` unit; without them the jailer execs Firecracker in place.
    """
    argv = [
        jailer,
        "--id", jail.jail_id,
        "--exec-file", firecracker,
        "--uid", str(uid),
        "--gid", str(gid),
        "--chroot-base-dir", str(jail.base_dir),
        "--cgroup-version", "2",
        "--parent-cgroup", unit_cgroup,
    ]
    if netns is not None:
        argv += ["--netns", str(netns)]
    return [*argv, "--", "--api-sock", API_SOCKET]


def guest_serial(path: Path) -> str:
    """The virtio-blk serial Firecracker gives the disk backed by `path`."""
    st = os.stat(path)
    return f"{st.st_dev}{st.st_rdev}{st.st_ino}"[:SERIAL_BYTES]


def guest_serials(files: Sequence[JailFile]) -> dict[str, str]:
    """``{drive_id: serial}``; two disks that would look alike to the guest are refused
    (only possible when the 20-byte cut or the digit concatenation collides)."""
    serials: dict[str, str] = {}
    for f in files:
        if f.drive_id is None:
            continue
        serial = guest_serial(f.source)
        for other, seen in serials.items():
            if seen == serial:
                raise FailedPrecondition(
                    f"firecracker: drives {other} and {f.drive_id} would both have the "
                    f"guest serial {serial} (is the same file attached twice?)")
        serials[f.drive_id] = serial
    return serials


def check_socket_paths(jail: Jail) -> None:
    for path in (jail.api_socket, jail.vsock_socket):
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise FailedPrecondition(
                f"firecracker: socket path {path} is longer than {MAX_SOCKET_PATH} bytes; "
                "use a shorter chroot_base_dir")


def socket_answers(path: Path) -> bool:
    """Whether something accepts connections on the unix socket `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(os.fspath(path))
        except OSError:
            return False
    return True


def _may_read(st: os.stat_result, uid: int, gid: int) -> bool:
    if uid == 0:
        return True
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IRUSR)
    if st.st_gid == gid:
        return bool(st.st_mode & stat.S_IRGRP)
    return bool(st.st_mode & stat.S_IROTH)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: Path, flags: int) -> None:
    src = os.fsencode(source) if source is not None else None
    if _libc().mount(src, os.fsencode(target), None, flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _umount(target: Path) -> None:
    if _libc().umount2(os.fsencode(target), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):  # not (or no longer) a mount point
            raise OSError(err, f"umount {target}: {os.strerror(err)}")


def mounts_under(directory: Path, proc: Path = procfs.PROC) -> list[Path]:
    """Mount points at or below `directory`, deepest first (the order to unmount)."""
    return procfs.mounts_under(procfs.read_mountinfo(proc), os.path.realpath(directory))


def _place(f: JailFile, target: Path) -> str:
    """Hard link `f` at `target`, or bind-mount it there; returns which."""
    try:
        os.link(f.source, target)
        return "link"
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    os.close(fd)
    _mount(os.fspath(f.source), target, _MS_BIND)
    if not f.writable:
        _mount(None, target, _MS_REMOUNT | _MS_BIND | _MS_RDONLY)
    return "bind"


def release(jail: Jail) -> None:
    """Undo `stage`: unmount what is mounted in the jail, remove the instance directory.

    Refused while a Firecracker still answers on the jail's API socket.  Hard links go
    with the directory (the pool files keep their other name); unlinking a file that is
    still a mount point fails (EBUSY), so nothing mounted is ever deleted through it."""
    if not jail.instance_dir.exists():
        return
    if socket_answers(jail.api_socket):
        raise FailedPrecondition(f"firecracker: a VMM still answers on {jail.api_socket}; "
                                 "stop its unit before releasing the jail")
    for point in mounts_under(jail.instance_dir):
        _umount(point)
    shutil.rmtree(jail.instance_dir)


def stage(jail: Jail, files: Sequence[JailFile], *, uid: int, gid: int) -> dict[str, str]:
    """Build the jail directory with every file in place; returns ``{jail_path: how}``
    (``link`` or ``bind``).  A leftover directory of an earlier start is released first.

    Raises FailedPrecondition naming the file when a shared file is not readable by the
    VMM account, or when something cannot be placed."""
    check_socket_paths(jail)
    if not jail.base_dir.is_dir():
        raise FailedPrecondition(f"firecracker: chroot_base_dir {jail.base_dir} does not "
                                 "exist (the node's probe creates it)")
    for f in files:
        st = os.stat(f.source)
        if not f.owned and not _may_read(st, uid, gid):
            raise FailedPrecondition(
                f"firecracker: {f.source} is not readable by the VMM account "
                f"(uid {uid}, gid {gid}); make it world-readable")
    release(jail)
    jail.instance_dir.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    jail.instance_dir.mkdir(mode=0o700)
    jail.root.mkdir(mode=0o700)
    how: dict[str, str] = {}
    try:
        for f in files:
            target = jail.host_path(f.jail_path)
            target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            if f.owned:
                os.chown(f.source, uid, gid)
                mode = stat.S_IMODE(os.stat(f.source).st_mode)
                os.chmod(f.source, mode | (0o600 if f.writable else 0o400))
            how[f.jail_path] = _place(f, target)
    except OSError as exc:
        with contextlib.suppress(OSError, FailedPrecondition):  # report the first error
            release(jail)
        raise FailedPrecondition(f"firecracker: cannot place files in the jail "
                                 f"{jail.root}: {exc}") from exc
    return how
