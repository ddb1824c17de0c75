"""Directory trees as tar streams: packing one, and unpacking one so that a failure
leaves nothing under the destination.

Blocking code on plain file objects (a `bridge` stream in the guest, a pipe or a local
file in ``kibo workspace cp``, which imports this module too), with bounded memory:
members stream through in 64 KiB pieces.

`pack` writes POSIX (pax) tar: modes, mtimes, owners (numeric and by name) and symlinks
as they are (never followed).  `Unpacker` extracts into a *staging directory* inside
the destination, so every byte lands in the destination's file system before anything
under the destination changes; `commit` then makes the staged files durable (one
``syncfs``), checks that nothing in the destination conflicts (a directory where the
archive has a file, or the reverse), renames the staged entries into place (directories
that exist already are merged into) and applies the directories' modes and mtimes last.
`discard` removes the staging directory: after ENOSPC, a permission error, a bad
archive or a cancelled transfer, the destination is as it was.

Member names are checked as tar's "data" filter would: no absolute names, no ``..``,
and nothing is ever written through a symlink (a symlink member ``a -> /etc`` followed
by ``a/passwd`` is refused).  Owners are kept only when `keep_owner` is set (the agent
running as root), unless `owner` names the one uid and gid of everything this unpacking
creates (a request's ``user``: what it unpacks is that user's, whoever packed it;
directories merged into keep theirs); devices, FIFOs and sockets are skipped and counted.
"""

from __future__ import annotations

import os
import stat
import tarfile

from ..errors import AgentError
from ..runtime.framing import DATA_CHUNK
from ..runtime.sysio import write_stream

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, BinaryIO, Protocol

    class Writer(Protocol):
        def write(self, data: bytes, /) -> int: ...

STAGING_PREFIX = ".kibotos-upload-"


def _bad(message: str, **details: Any) -> AgentError:
    return AgentError("invalid_argument", message, {"reason": "bad_archive", **details})


def pack(source: str, arcname: str, out: Writer) -> int:
    """Write `source` (a file, a symlink or a whole tree) to `out` as `arcname`;
    returns the number of members."""
    members = 0

    def exact(info: tarfile.TarInfo) -> tarfile.TarInfo:
        """tarfile keeps mtimes as floats (a microsecond off at today's dates): write
        the nanoseconds into the pax header, which `Unpacker` reads back exactly."""
        nonlocal members
        members += 1
        ns = os.lstat(source + info.name[len(arcname):]).st_mtime_ns
        if ns >= 0:
            info.mtime = ns // 1_000_000_000
            info.pax_headers = {**info.pax_headers,
                                "mtime": f"{ns // 1_000_000_000}.{ns % 1_000_000_000:09d}"}
        return info

    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT,  # type: ignore[call-overload]
                      bufsize=DATA_CHUNK) as tar:
        tar.add(source, arcname=arcname, recursive=True, filter=exact)
    return members


def _mtime_ns(m: tarfile.TarInfo) -> int:
    """The member's mtime in nanoseconds, exactly when its pax header has them."""
    text = m.pax_headers.get("mtime", "")
    whole, _, fraction = text.partition(".")
    if whole.isdigit() and (not fraction or fraction.isdigit()):
        return int(whole) * 1_000_000_000 + int((fraction + "0" * 9)[:9])
    return int(m.mtime * 1_000_000_000)


def safe_name(name: str) -> str:
    """A member name as a relative path inside the destination, or "" for the
    archive's own ``.``."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if name.startswith("/") or ".." in parts or "\0" in name:
        raise _bad(f"tar member {name!r} is absolute or leaves the destination", member=name)
    return "/".join(parts)


class Unpacker:
    """Extract a tar stream into `dest` (an existing directory) through a staging
    directory; see the module docstring."""

    def __init__(self, dest: str, *, keep_owner: bool, rename_top: str | None = None,
                 owner: tuple[int, int] | None = None) -> None:
        self.dest = dest
        self.keep_owner = keep_owner
        self.owner = owner
        self.rename_top = rename_top
        self.staging = os.path.join(dest, f"{STAGING_PREFIX}{os.urandom(6).hex()}")
        os.mkdir(self.staging, 0o700)
        self.members = 0
        self.skipped: list[str] = []
        self._dirs: dict[str, tuple[int, int, int, int]] = {}  # rel → mode, mtime, uid, gid
        self._made: set[str] = {""}
        self._existing: set[str] = set()  # directories merged into, not created

    # -- extraction

    def extract(self, source: BinaryIO) -> None:
        """Read the whole archive from `source` into the staging directory."""
        try:
            tar = tarfile.open(fileobj=source, mode="r|", bufsize=DATA_CHUNK)  # noqa: SIM115
        except tarfile.ReadError as e:
            raise _bad(f"not a tar archive: {e}") from None
        try:
            for member in tar:
                self._member(tar, member)
        except tarfile.TarError as e:
            raise _bad(f"bad tar archive: {e}") from None
        finally:
            tar.close()

    def _rel(self, name: str) -> str:
        rel = safe_name(name)
        if self.rename_top and rel:
            _, sep, rest = rel.partition("/")
            rel = self.rename_top + sep + rest
        return rel

    def _parent(self, rel: str) -> str:
        """Make sure every directory above `rel` is one this unpacking made (so nothing
        is written through a symlink from the archive); returns the staged path."""
        parts = rel.split("/")
        for i in range(1, len(parts)):
            prefix = "/".join(parts[:i])
            if prefix in self._made:
                continue
            path = os.path.join(self.staging, prefix)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                os.mkdir(path, 0o700)
                self._dirs.setdefault(prefix, (-1, -1, -1, -1))  # not in the archive
            else:
                if not stat.S_ISDIR(st.st_mode):
                    raise _bad(f"tar member {rel!r} would be written through "
                               f"{prefix!r}, which is not a directory", member=rel)
            self._made.add(prefix)
        return os.path.join(self.staging, rel)

    def _member(self, tar: tarfile.TarFile, m: tarfile.TarInfo) -> None:
        rel = self._rel(m.name)
        if not rel:
            return  # the archive's own "." (tar -C dir .): the destination itself
        path = self._parent(rel)
        mtime_ns = _mtime_ns(m)
        if m.isdir():
            if rel in self._made:
                os.chmod(path, 0o700)
            else:
                if os.path.lexists(path):
                    raise _bad(f"tar member {rel!r} is a directory and also something else",
                               member=rel)
                os.mkdir(path, 0o700)
                self._made.add(rel)
            self._dirs[rel] = (m.mode & 0o7777, mtime_ns, m.uid, m.gid)
        elif m.isreg():
            self._replace_slot(path, rel)
            self._file(tar, m, path)
        elif m.issym():
            self._replace_slot(path, rel)
            os.symlink(m.linkname, path)
        elif m.islnk():
            target = safe_name(m.linkname)
            target = self._rel(m.linkname) if target else target
            source = os.path.join(self.staging, target)
            if not target or target in self._made or not os.path.lexists(source):
                raise _bad(f"tar member {rel!r} is a hard link to {m.linkname!r}, which is "
                           "not a file earlier in the archive", member=rel)
            self._parent(target)
            self._replace_slot(path, rel)
            os.link(source, path, follow_symlinks=False)
            self.members += 1
            return
        else:
            self.skipped.append(rel)
            return
        self.members += 1
        if not m.isdir():
            self._meta(path, m, mtime_ns)

    def _replace_slot(self, path: str, rel: str) -> None:
        """A later member of the same name replaces an earlier one (as tar does), but
        never a directory."""
        if rel in self._made:
            raise _bad(f"tar member {rel!r} replaces a directory", member=rel)
        if os.path.lexists(path):
            os.unlink(path)

    def _file(self, tar: tarfile.TarFile, m: tarfile.TarInfo, path: str) -> None:
        data = tar.extractfile(m)
        assert data is not None
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            write_stream(fd, data, DATA_CHUNK)
        finally:
            os.close(fd)

    def _meta(self, path: str, m: tarfile.TarInfo, mtime_ns: int) -> None:
        link = m.issym()
        if self.owner is not None:
            os.chown(path, *self.owner, follow_symlinks=False)
        elif self.keep_owner:
            os.chown(path, m.uid, m.gid, follow_symlinks=False)
        if not link:
            os.chmod(path, m.mode & 0o7777)
        os.utime(path, ns=(mtime_ns, mtime_ns), follow_symlinks=False)

    # -- commit and discard

    def commit(self) -> list[str]:
        """Durable, checked, then renamed into place; returns the top-level names."""
        from ..runtime.sysio import syncfs_path

        syncfs_path(self.staging)
        tops = sorted(os.listdir(self.staging))
        for name in tops:
            self._check_conflicts(name)
        for name in tops:
            self._merge(name)
        for rel in sorted(self._dirs, key=lambda r: r.count("/"), reverse=True):
            mode, mtime_ns, uid, gid = self._dirs[rel]
            path = os.path.join(self.dest, rel)
            if self.owner is not None and rel not in self._existing:
                os.chown(path, *self.owner)
            if mode < 0:  # made only to hold members: a new one gets mkdir's default
                if rel not in self._existing:
                    os.chmod(path, 0o755)
                continue
            if self.owner is None and self.keep_owner:
                os.chown(path, uid, gid)
            os.chmod(path, mode)
            os.utime(path, ns=(mtime_ns, mtime_ns))
        os.rmdir(self.staging)
        syncfs_path(self.dest)
        return tops

    def _check_conflicts(self, rel: str) -> None:
        staged = os.path.join(self.staging, rel)
        try:
            there = os.lstat(os.path.join(self.dest, rel))
        except FileNotFoundError:
            return
        staged_dir = stat.S_ISDIR(os.lstat(staged).st_mode)
        if staged_dir != stat.S_ISDIR(there.st_mode):
            what = ("a directory with a non-directory" if stat.S_ISDIR(there.st_mode)
                    else "a non-directory with a directory")
            raise AgentError("failed_precondition",
                             f"{rel} exists in the destination: cannot overwrite {what}; "
                             "nothing was changed", {"reason": "type_conflict", "member": rel})
        if staged_dir:
            for name in os.listdir(staged):
                self._check_conflicts(f"{rel}/{name}")

    def _merge(self, rel: str) -> None:
        staged = os.path.join(self.staging, rel)
        final = os.path.join(self.dest, rel)
        if os.path.isdir(staged) and not os.path.islink(staged) and os.path.isdir(final) \
                and not os.path.islink(final):
            self._existing.add(rel)
            for name in sorted(os.listdir(staged)):
                self._merge(f"{rel}/{name}")
            os.rmdir(staged)
        else:
            os.replace(staged, final)

    def discard(self) -> None:
        """Remove the staging directory and everything in it (safe to repeat)."""
        import shutil

        def unlock(func: Any, path: str, exc: Any) -> None:
            os.chmod(os.path.dirname(path), 0o700)
            func(path)

        if os.path.lexists(self.staging):
            shutil.rmtree(self.staging, onerror=unlock)


def result(unpacker: Unpacker) -> dict[str, Any]:
    return {"members": unpacker.members, "skipped": unpacker.skipped[:100],
            "skipped_count": len(unpacker.skipped)}
