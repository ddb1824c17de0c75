"""``file_stat``, ``file_mkdir``, ``file_move``, ``file_remove``, and the pieces the
transfers share (the walk of ``file_list``, finishing an uploaded file).

Each request runs in a worker thread (`run_in_thread`): a stat on a stuck mount must
not stop the loop.  Writes are refused while the guest is prepared for stop (its file
systems are frozen, and a write would hang).
"""

from __future__ import annotations

import os
import stat

from ..errors import AgentError, field, guest_path, int_field, invalid, user_field
from ..runtime.tasks import run_in_thread
from .bridge import writable
from .fileinfo import Names, entry, lstat_entry, os_error

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from ..core import Agent
    from ..runtime.channel import Channel


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def owner_fields(msg: dict[str, Any]) -> tuple[int | None, int | None]:
    """uid and gid of what a request creates: its ``user``'s, else its ``uid``/``gid``."""
    named = user_field(msg)
    if named is not None:
        return named.pw_uid, named.pw_gid
    return int_field(msg, "uid", 0, 2**32 - 2, None), int_field(msg, "gid", 0, 2**32 - 2, None)


def make_parents(directory: str, uid: int | None, gid: int | None) -> None:
    """``mkdir -p`` of `directory` (0755), each directory it made owned by uid/gid: a
    user who writes ``/home/user/a/b/f`` must own ``a`` and ``b`` too, or cannot write
    beside the file later.  Existing directories are left as they are."""
    missing: list[str] = []
    while not os.path.isdir(directory):
        missing.append(directory)
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:
            if not os.path.isdir(path):
                raise
            continue  # made meanwhile by someone else: theirs
        if uid is not None or gid is not None:
            os.chown(path, -1 if uid is None else uid, -1 if gid is None else gid)


def finish_file(fd: int, old: os.stat_result | None, mode: int | None, uid: int | None,
                gid: int | None, mtime_ns: int | None) -> None:
    """Owner, mode and mtime of an uploaded file before it is renamed into place.  A
    file that replaces another keeps the old one's mode and (as root) owner unless the
    request says otherwise; a new one is 0644, owned by the agent."""
    if old is not None and os.geteuid() == 0:
        uid = old.st_uid if uid is None else uid
        gid = old.st_gid if gid is None else gid
    if uid is not None or gid is not None:
        os.fchown(fd, -1 if uid is None else uid, -1 if gid is None else gid)
    if mode is None:
        mode = stat.S_IMODE(old.st_mode) if old is not None else 0o644
    os.fchmod(fd, mode)  # after the chown, which clears set-id bits
    if mtime_ns is not None:
        os.utime(fd, ns=(mtime_ns, mtime_ns))


def walk(guest: str, real: str, depth: int, names: Names, counts: dict[str, int],
         emit: Callable[[dict[str, Any]], object]) -> None:
    """Every entry under `real` down to `depth` levels, sorted by name, each directory
    followed by its own entries; symlinks are listed, never followed.  Entries that
    vanish meanwhile are left out; directories that cannot be read are counted."""
    try:
        with os.scandir(real) as listing:
            children = sorted(e.name for e in listing)
    except OSError:
        counts["unreadable"] += 1
        return
    for name in children:
        g, r = os.path.join(guest, name), os.path.join(real, name)
        try:
            st = os.lstat(r)
        except FileNotFoundError:
            continue
        emit(entry(g, r, st, names))
        counts["entries"] += 1
        if depth > 1 and stat.S_ISDIR(st.st_mode):
            walk(g, r, depth - 1, names, counts, emit)


def _in_thread(what: str, path: str, work: Callable[[], dict[str, Any]]) -> Any:
    def guarded() -> dict[str, Any]:
        try:
            return work()
        except OSError as e:
            raise os_error(e, what, path) from None

    return run_in_thread(guarded)


async def stat_request(agent: Agent, ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
    path = guest_path(field(msg, "path", str), "file_stat: path")
    real = agent.path(path)
    result: dict[str, Any] = await _in_thread(
        "file_stat", path, lambda: {"entry": lstat_entry(path, real, "file_stat")})
    return result


async def mkdir_request(agent: Agent, ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
    path = guest_path(field(msg, "path", str), "file_mkdir: path")
    parents = field(msg, "parents", bool, True)
    mode = int_field(msg, "mode", 0, 0o7777, 0o755)
    uid, gid = owner_fields(msg)
    writable(agent, "file_mkdir")
    real = agent.path(path)

    def work() -> dict[str, Any]:
        try:
            st = os.lstat(real)
        except FileNotFoundError:
            st = None
        if st is not None:
            if not stat.S_ISDIR(st.st_mode):
                raise AgentError("already_exists", f"file_mkdir {path}: exists and is not "
                                 "a directory", {"path": path})
            return {"entry": lstat_entry(path, real, "file_mkdir"), "created": False}
        if parents:
            make_parents(os.path.dirname(real), uid, gid)
        os.mkdir(real, 0o700)
        if uid is not None or gid is not None:
            os.chown(real, -1 if uid is None else uid, -1 if gid is None else gid)
        os.chmod(real, mode)  # exactly, whatever the umask
        return {"entry": lstat_entry(path, real, "file_mkdir"), "created": True}

    result: dict[str, Any] = await _in_thread("file_mkdir", path, work)
    return result


async def move_request(agent: Agent, ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
    source = guest_path(field(msg, "source", str), "file_move: source")
    destination = guest_path(field(msg, "destination", str), "file_move: destination")
    if "/" in (source, destination):
        raise invalid("file_move: cannot move / or onto /")
    writable(agent, "file_move")
    real_source, real_destination = agent.path(source), agent.path(destination)

    def work() -> dict[str, Any]:
        os.lstat(real_source)  # a missing source is named as the source
        try:
            os.rename(real_source, real_destination)
        except OSError as e:
            raise os_error(e, "file_move", f"{source} -> {destination}") from None
        return {"entry": lstat_entry(destination, real_destination, "file_move")}

    result: dict[str, Any] = await _in_thread("file_move", source, work)
    return result


async def remove_request(agent: Agent, ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
    path = guest_path(field(msg, "path", str), "file_remove: path")
    recursive = field(msg, "recursive", bool, False)
    if path == "/":
        raise invalid("file_remove: refusing to remove /")
    writable(agent, "file_remove")
    real = agent.path(path)

    def work() -> dict[str, Any]:
        st = os.lstat(real)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(real)
        elif recursive:
            import shutil

            def fail(func: Any, where: str, exc: BaseException) -> None:
                raise exc

            shutil.rmtree(real, onerror=lambda f, p, e: fail(f, p, e[1]))
        else:
            os.rmdir(real)
        return {"type": "directory" if stat.S_ISDIR(st.st_mode) else "file"}

    result: dict[str, Any] = await _in_thread("file_remove", path, work)
    return result
