"""``file_watch``: the changes in a directory (and, with ``recursive``, below it) as a
stream of JSON lines, for as long as the host keeps the transfer open.

The standard library has no binding of inotify, so its three calls go through ctypes
(loaded with the first watch; a Template needs nothing but ``python3``).  The worker
thread of the transfer (`bridge`) waits in ``poll`` on the inotify descriptor and on a
wake-up pipe that a cancel writes to, so an idle watch costs nothing and a cancel ends
it at once.

Each inotify event is one line ``{"name": <path relative to the watched directory>,
"type": create|write|remove|rename|chmod}`` (the five kinds of envd's ``WatchDir``:
``IN_CREATE``/``IN_MOVED_TO`` create, ``IN_MODIFY`` write, ``IN_DELETE`` remove,
``IN_MOVED_FROM`` rename, ``IN_ATTRIB`` chmod).  Memory is bounded: lines go out under
the host's credit, and while the host does not take them the kernel's own queue fills;
when it overflows (``IN_Q_OVERFLOW``, ``fs.inotify.max_queued_events``) the stream
carries ``{"type": "overflow"}`` and goes on.  Directories created or moved in below a
recursive watch are watched as they appear; what a new directory already holds when
its watch is set (made in the moment between) is reported as created (and written, a
file with content), so nothing is missed; an entry both found so and then reported by
the kernel (made after the watch was set, before the listing reached it) is created
once: the later event is dropped when the name is still the inode the listing saw.
When the watched directory itself is removed or unmounted the stream ends normally
(EOF, then ``transfer_end``).

The agent's own uploads write a temporary file and rename it into place: the
temporary name is not reported, and the file it becomes is ``create`` then ``write``
(what envd reports for a new file written).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import select
import struct

from ..errors import AgentError, field, guest_path
from .bridge import Outbound
from .downloads import cleaned_up, start_download
from .fileinfo import lstat_entry, os_error
from .tarstream import STAGING_PREFIX

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from ..core import Agent
    from ..runtime.channel import Channel
    from .downloads import Body

IN_MODIFY, IN_ATTRIB, IN_MOVED_FROM, IN_MOVED_TO = 0x2, 0x4, 0x40, 0x80
IN_CREATE, IN_DELETE, IN_DELETE_SELF, IN_MOVE_SELF = 0x100, 0x200, 0x400, 0x800
IN_Q_OVERFLOW, IN_IGNORED, IN_ISDIR = 0x4000, 0x8000, 0x40000000
IN_ONLYDIR, IN_DONT_FOLLOW, IN_EXCL_UNLINK = 0x01000000, 0x02000000, 0x04000000
IN_NONBLOCK, IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
MASK = (IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
        | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR | IN_DONT_FOLLOW | IN_EXCL_UNLINK)
#: inotify bits as envd's event kinds, the first that matches wins.
KINDS = ((IN_CREATE | IN_MOVED_TO, "create"), (IN_DELETE, "remove"),
         (IN_MOVED_FROM, "rename"), (IN_MODIFY, "write"), (IN_ATTRIB, "chmod"))
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name
READ_SIZE = 64 * 1024
#: `uploads`' temporary files (``.NAME.kibotos-XXXXXXXX.tmp``).
_TEMPORARY = re.compile(r"\..*\.kibotos-[0-9a-f]{8}\.tmp", re.DOTALL)
MAX_PENDING_MOVES = 1024
#: Entries found by listing a new directory whose own create may still come (`_Inotify.found`).
MAX_FOUND = 65536


class _Inotify:
    """One inotify instance: the watches and which directory each one is."""

    def __init__(self, what: str, path: str) -> None:
        import ctypes

        self.what, self.path = what, path
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._get_errno = ctypes.get_errno
        self.fd = self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self.fd < 0:
            raise self._error("inotify_init1")
        self.dirs: dict[int, str] = {}  # watch descriptor -> directory relative to the top
        #: Names reported from a listing (relative -> inode), until the kernel's event.
        self.found: dict[str, int] = {}

    def _error(self, call: str) -> AgentError:
        err = self._get_errno()
        if err in (errno.ENOSPC, errno.EMFILE):
            return AgentError("resource_exhausted", f"{self.what} {self.path}: the guest's "
                              "inotify limit is reached (fs.inotify.max_user_watches, "
                              "max_user_instances)", {"path": self.path,
                                                      "reason": "watch_limit"})
        return os_error(OSError(err, os.strerror(err)), self.what, self.path)

    def add(self, real: str, relative: str) -> None:
        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(real), MASK)
        if wd < 0:
            if relative and self._get_errno() in (errno.ENOENT, errno.ENOTDIR):
                return  # gone (or replaced) before it could be watched: nothing to see
            raise self._error("inotify_add_watch")
        self.dirs[wd] = relative

    def add_tree(self, real: str, relative: str, found: list[bytes] | None = None) -> None:
        """`real` and every directory below it (symlinks are not followed).  With
        `found`, the entries already there are reported into it: in a directory that
        was just created they are new (create, and write for a file with content),
        though made before its watch could see them."""
        self.add(real, relative)
        try:
            children = list(os.scandir(real))
        except OSError:
            return  # unreadable or gone: its own watch (if any) still reports
        for child in children:
            name = f"{relative}/{child.name}" if relative else child.name
            if found is not None and not _own(child.name):
                found.append(_line(name, "create"))
                try:
                    written = child.is_file(follow_symlinks=False) and \
                        child.stat(follow_symlinks=False).st_size > 0
                except OSError:
                    written = False  # gone again: its remove is reported
                if written:
                    found.append(_line(name, "write"))
                if len(self.found) >= MAX_FOUND:
                    self.found.clear()  # their creates came before the watch: never due
                self.found[name] = child.inode()
            if child.is_dir(follow_symlinks=False):
                self.add_tree(child.path, name, found)

    def reported_already(self, relative: str, real: str) -> bool:
        """Whether the kernel's create of `relative` is one a listing reported: the
        name is still (or no longer) the inode the listing found."""
        inode = self.found.pop(relative, None)
        if inode is None:
            return False
        try:
            return os.lstat(real).st_ino == inode
        except OSError:
            return True  # gone again: the listing's create stands, its remove follows

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _WatchOutbound(Outbound):
    """The watch's stream; a cancel also wakes the thread out of its ``poll``."""

    def __init__(self, channel: Channel, stream_id: int) -> None:
        super().__init__(channel, stream_id)
        self.wake_read, self.wake_write = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)

    def cancel(self, why: str) -> None:
        super().cancel(why)
        with self.cond:
            if self.wake_write >= 0:
                with contextlib.suppress(BlockingIOError):  # a wake-up is pending already
                    os.write(self.wake_write, b"x")

    def close_pipe(self) -> None:
        with self.cond:
            for fd in (self.wake_read, self.wake_write):
                if fd >= 0:
                    os.close(fd)
            self.wake_read = self.wake_write = -1


def _own(name: str) -> bool:
    """A name the agent's own uploads use while they are written (`uploads`,
    `tarstream`): their churn is not the user's, the rename into place is."""
    return bool(_TEMPORARY.fullmatch(name)) or name.startswith(STAGING_PREFIX)


def _line(name: str, kind: str) -> bytes:
    return json.dumps({"name": name, "type": kind}, separators=(",", ":")).encode() + b"\n"


def _lines(watch: _Inotify, data: bytes, recursive: bool, real: str, moved: set[int]
           ) -> tuple[list[bytes], bool]:
    """The JSON lines of a batch of inotify events, and whether the top went away.
    `moved` holds the cookies of the agent's temporary files renamed away: the file
    they become is reported as created and written, as envd reports a new file."""
    lines: list[bytes] = []
    top_gone = False
    offset = 0
    while offset + _EVENT.size <= len(data):
        wd, mask, cookie, size = _EVENT.unpack_from(data, offset)
        raw = data[offset + _EVENT.size:offset + _EVENT.size + size].rstrip(b"\0")
        offset += _EVENT.size + size
        if mask & IN_Q_OVERFLOW:
            lines.append(b'{"type":"overflow"}\n')
            continue
        directory = watch.dirs.get(wd)
        if directory is None:
            continue
        if mask & IN_IGNORED:
            del watch.dirs[wd]
            top_gone = top_gone or directory == ""
            continue
        if not raw:
            continue  # the directory's own DELETE_SELF/MOVE_SELF: its parent reported it
        name = os.fsdecode(raw)
        relative = f"{directory}/{name}" if directory else name
        if _own(name):
            if mask & IN_MOVED_FROM:
                if len(moved) > MAX_PENDING_MOVES:
                    moved.clear()  # renamed out of sight: their other halves never come
                moved.add(cookie)
            continue
        kind = next((k for bits, k in KINDS if mask & bits), None)
        if kind == "create" and watch.found and \
                watch.reported_already(relative, os.path.join(real, relative)):
            continue  # listed (and, a directory, watched) when its parent appeared
        if kind in ("remove", "rename"):
            watch.found.pop(relative, None)
        if kind is not None:
            lines.append(_line(relative, kind))
        if mask & IN_MOVED_TO and cookie in moved:
            moved.discard(cookie)
            lines.append(_line(relative, "write"))
        if recursive and mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO):
            found: list[bytes] | None = [] if mask & IN_CREATE else None
            watch.add_tree(os.path.join(real, relative), relative, found)
            lines += found or ()
    return lines, top_gone


async def file_watch(agent: Agent, ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
    path = guest_path(field(msg, "path", str), "file_watch: path")
    recursive = field(msg, "recursive", bool, False)
    real = agent.path(path)
    watches: list[_Inotify] = []
    outs: list[_WatchOutbound] = []

    def prepare(out: Outbound) -> Body:
        def run() -> dict[str, Any]:
            top = lstat_entry(path, real, "file_watch")
            if top["type"] != "directory":
                raise AgentError("failed_precondition", f"file_watch {path}: not a "
                                 "directory", {"reason": "not_directory", "path": path})
            watches.append(_Inotify("file_watch", path))
            if recursive:
                watches[0].add_tree(real, "")
            else:
                watches[0].add(real, "")
            return {"entry": top}  # the watches are set: every later change is seen
        return run

    def body(out: Outbound) -> Body:
        def run() -> dict[str, Any]:
            watch, events = watches[0], 0
            moved: set[int] = set()
            poller = select.poll()
            poller.register(watch.fd, select.POLLIN)
            poller.register(outs[0].wake_read, select.POLLIN)
            while True:
                poller.poll()
                out.check_cancelled()
                try:
                    data = os.read(watch.fd, READ_SIZE)
                except BlockingIOError:
                    continue
                lines, top_gone = _lines(watch, data, recursive, real, moved)
                if lines:
                    events += len(lines)
                    out.write(b"".join(lines))
                    out.push()
                if top_gone:
                    out.finish()
                    return {"bytes": out.count, "sha256": out.hexdigest(), "events": events}
        return run

    def cleanup() -> None:
        while watches:
            watches.pop().close()
        for o in outs:
            o.close_pipe()

    def outbound(channel: Channel, stream_id: int) -> Outbound:
        outs.append(_WatchOutbound(channel, stream_id))
        return outs[0]

    return await start_download(ch, msg, "file_watch", path, prepare,
                                cleaned_up(body, cleanup), cleanup,
                                outbound=outbound)
