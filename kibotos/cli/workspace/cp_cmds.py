"""``kibo workspace cp SRC DST``: copy files and directory trees into and out of a
Workspace, in the manner of ``docker cp`` and ``kubectl cp``.

Exactly one side is ``WORKSPACE:PATH`` (PATH absolute in the guest); the other is a
local path, or ``-`` for a tar stream on standard input or output.  kibo asks ctrl for
a session credential that grants ``files`` and moves the bytes through the Workspace
node's data plane (`kibotos.dataplane.clients.files_client`), never through ctrl.

* A regular file is sent as its bytes (mode and mtime kept); anything else (a
  directory, a symlink) as a tar stream (modes, mtimes and symlinks kept; owners as
  the guest agent's root keeps them; with ``--user NAME``, what lands in the Workspace
  is that guest user's).  As with ``cp -r``: when DST is an existing
  directory the copy lands inside it under SRC's name, otherwise it is created as DST.
* Every byte is checked with sha256 end to end: the guest refuses an upload whose bytes
  do not hash to what kibo sent (nothing is renamed into place), and kibo refuses a
  download whose bytes do not hash to what the guest read (the local file is not
  written).  Both sides write to a temporary file or staging directory and rename.
* Memory stays bounded whatever the size (a few 256 KiB chunks in flight), and with a
  terminal on stderr a large transfer shows its progress there.

Exit codes are docs/cli.md's: 12 a path (local or in the guest) does not exist, 11
permission denied, 15 a full disk (in the guest or here), 13 a type conflict (a file
where a directory is, a Workspace not AVAILABLE), 17 the data plane unreachable.
"""

from __future__ import annotations

import os
import stat
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from kibotos.cli.core.options import Invocation, kibo_options
from kibotos.core import ids
from kibotos.core.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound

if TYPE_CHECKING:  # for an https:// data plane only
    import ssl

#: Progress is shown for transfers at least this large (or of unknown size past it).
PROGRESS_FROM = 8 << 20
PROGRESS_EVERY = 0.5


@dataclass(frozen=True)
class LocalPath:
    """What kibo needs to know of a local path, looked at once (in a thread)."""

    path: str
    absolute: str
    lstat: os.stat_result | None
    is_dir: bool  # following symlinks, as `cp` does for a destination
    name: str  # the last component, of ./x/ too


def look(path: str) -> LocalPath:
    try:
        st: os.stat_result | None = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        from kibotos.cli.workspace.cp_local import local_error

        raise local_error(exc, f"looking at {path}") from None
    absolute = os.path.abspath(path)
    return LocalPath(path, absolute, st, os.path.isdir(path),
                     os.path.basename(os.path.normpath(absolute)))


@dataclass(frozen=True)
class Remote:
    workspace: str
    path: str


def parse_side(text: str) -> Remote | str:
    """``WS:PATH`` (a valid workspace ID before the first colon) or a local path; write
    ``./a:b`` for a local name with a colon in it."""
    head, sep, tail = text.partition(":")
    if not sep or "/" in head:
        return text
    try:
        workspace = ids.check_object_id(head, "workspace ID")
    except InvalidArgument:
        return text
    if not tail.startswith("/"):
        raise InvalidArgument(f"{text!r}: the path in the Workspace must be absolute "
                              f"({head}:/{tail or ''})")
    return Remote(workspace, os.path.normpath(tail) if tail != "/" else "/")


class Progress:
    """``name  12.0 MiB / 64.0 MiB  18%  9.1 MiB/s`` on stderr, rewritten in place."""

    def __init__(self, name: str, total: int | None, *, enabled: bool) -> None:
        self.name = name
        self.total = total
        self.enabled = enabled
        self.done = 0
        self._start = time.monotonic()
        self._last = 0.0
        self._shown = False

    def add(self, count: int) -> None:
        self.done += count
        now = time.monotonic()
        if not self.enabled or now - self._last < PROGRESS_EVERY:
            return
        if (self.total or self.done) < PROGRESS_FROM:
            return
        self._last = now
        self._show(now)

    def _show(self, now: float) -> None:
        rate = self.done / max(now - self._start, 1e-6)
        mib = 1 << 20
        size = f"{self.done / mib:.1f} MiB"
        if self.total:
            size += f" / {self.total / mib:.1f} MiB  {100 * self.done // self.total}%"
        sys.stderr.write(f"\r{self.name}  {size}  {rate / mib:.1f} MiB/s\x1b[K")
        sys.stderr.flush()
        self._shown = True

    def finish(self) -> None:
        if self._shown:
            self._show(time.monotonic())
            sys.stderr.write("\n")
            sys.stderr.flush()


class Counted:
    """An async iterable of chunks that reports each to a `Progress`."""

    def __init__(self, chunks: Any, progress: Progress) -> None:
        self._chunks = chunks.__aiter__()
        self._progress = progress

    def __aiter__(self) -> Counted:
        return self

    async def __anext__(self) -> bytes:
        chunk: bytes = await self._chunks.__anext__()
        self._progress.add(len(chunk))
        return chunk


async def copy(url: str, credential: str, src: Remote | str, dst: Remote | str, *,
               show_progress: bool = False, stdin_fd: int = 0, stdout_fd: int = 1,
               ssl_context: ssl.SSLContext | None = None, user: str | None = None
               ) -> dict[str, Any]:
    """Copy `src` to `dst` (exactly one `Remote`, the other a local path or ``-``)
    through the data plane at `url`; returns what was copied.  `user` (a guest user
    name, into a Workspace only) owns what the copy creates there."""
    from kibotos.dataplane.clients.files_client import FilesClient

    client = FilesClient(url, credential, ssl_context=ssl_context)
    if isinstance(dst, Remote):
        assert not isinstance(src, Remote)
        return await _upload(client, src, dst, show_progress, stdin_fd, user)
    assert isinstance(src, Remote)
    if user is not None:
        raise InvalidArgument("--user applies to a copy into a Workspace: a copy out of "
                              "it reads as the guest agent's user")
    return await _download(client, src, dst, show_progress, stdout_fd)


async def _remote_kind(client: Any, path: str) -> str | None:
    try:
        return str((await client.stat(path)).type)
    except NotFound:
        return None


async def _upload(client: Any, src: str, dst: Remote, show: bool, stdin_fd: int,
                  user: str | None = None) -> dict[str, Any]:
    import trio

    from kibotos.cli.workspace.cp_local import FdChunks, local_errors, pack_tree

    if src == "-":  # a tar on stdin, unpacked into the existing directory DST
        progress = Progress("-", None, enabled=show)
        answer = await client.upload("tar", dst.path,
                                     Counted(FdChunks(stdin_fd, "reading stdin"), progress),
                                     user=user)
        progress.finish()
        return {"to": f"{dst.workspace}:{dst.path}", **_summary(answer)}
    local = await trio.to_thread.run_sync(look, src)
    if local.lstat is None:
        raise NotFound(f"the local path {src} does not exist")
    st = local.lstat
    kind = await _remote_kind(client, dst.path)
    name = local.name
    if kind == "directory":
        parent, leaf = dst.path, name
    elif kind is None or (stat.S_ISREG(st.st_mode) and kind != "directory"):
        parent, leaf = os.path.dirname(dst.path), os.path.basename(dst.path)
    else:
        raise FailedPrecondition(f"{dst.workspace}:{dst.path} exists and is not a "
                                 f"directory: cannot copy the directory {src} onto it")
    target = os.path.join(parent, leaf)
    progress = Progress(name, st.st_size if stat.S_ISREG(st.st_mode) else None,
                        enabled=show)
    if stat.S_ISREG(st.st_mode):
        with local_errors(f"reading {src}"):
            fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
        try:
            answer = await client.upload(
                "content", target, Counted(FdChunks(fd, f"reading {src}"), progress),
                mode=f"{stat.S_IMODE(st.st_mode):o}", mtime_ns=st.st_mtime_ns, user=user)
        finally:
            os.close(fd)
    else:
        async with trio.open_nursery() as nursery:
            tar = pack_tree(nursery, src, leaf)
            answer = await client.upload("tar", parent, Counted(tar, progress), user=user)
    progress.finish()
    return {"to": f"{dst.workspace}:{target}", **_summary(answer)}


async def _download(client: Any, src: Remote, dst: str, show: bool, stdout_fd: int
                    ) -> dict[str, Any]:
    import trio

    from kibotos.cli.workspace.cp_local import LocalFile, unpack_tree, write_all

    name = os.path.basename(src.path) or "."
    if dst == "-":  # SRC as a tar on stdout
        progress = Progress(name, None, enabled=show)
        async with client.download("tar", src.path) as down:
            async for chunk in Counted(down.chunks(), progress):
                await trio.to_thread.run_sync(write_all, stdout_fd, chunk)
        progress.finish()
        return {"from": f"{src.workspace}:{src.path}", "bytes": down.received,
                "sha256": down.sha256}
    entry = await client.stat(src.path)
    here = await trio.to_thread.run_sync(look, dst)
    local_dir = here.is_dir
    target = os.path.join(dst, name) if local_dir else dst
    if entry.type == "file":
        if (await trio.to_thread.run_sync(look, target)).is_dir:
            raise FailedPrecondition(f"{target} is a directory: cannot copy the file "
                                     f"{src.workspace}:{src.path} onto it")
        progress = Progress(name, entry.size, enabled=show)
        file = await trio.to_thread.run_sync(LocalFile, target)
        try:
            async with client.download("content", src.path) as down:
                async for chunk in Counted(down.chunks(), progress):
                    await file.write(chunk)
            await file.commit(entry.mode, entry.mtime_ns)
        except BaseException:
            file.discard()
            raise
        progress.finish()
        return {"from": f"{src.workspace}:{src.path}", "to": target,
                "bytes": down.received, "sha256": down.sha256}
    parent = dst if local_dir else os.path.dirname(here.absolute)
    if not local_dir and here.lstat is not None:
        raise FailedPrecondition(f"{dst} exists and is not a directory: cannot copy the "
                                 f"{entry.type} {src.workspace}:{src.path} onto it")
    if not (await trio.to_thread.run_sync(look, parent)).is_dir:
        raise NotFound(f"the local directory {parent} does not exist")
    progress = Progress(name, None, enabled=show)
    async with client.download("tar", src.path, arcname=name) as down:
        await unpack_tree(Counted(down.chunks(), progress), parent,
                          None if local_dir else os.path.basename(dst))
    progress.finish()
    return {"from": f"{src.workspace}:{src.path}", "to": target, "bytes": down.received,
            "sha256": down.sha256}


def _summary(answer: dict[str, Any]) -> dict[str, Any]:
    keep = ("bytes", "sha256", "members", "skipped_count")
    return {k: answer[k] for k in keep if k in answer}


@click.command("cp")
@click.argument("src")
@click.argument("dst")
@click.option("--user", "-u", metavar="NAME", help="Create what lands in the Workspace as "
              "this user of the guest (default: the guest agent's user, root).")
@kibo_options
def cp_command(inv: Invocation, src: str, dst: str, user: str | None) -> None:
    """Copy SRC to DST, one of them WORKSPACE:PATH in an AVAILABLE Workspace.

    \b
    kibo workspace cp ./build.tar.gz ws-01k…:/tmp/
    kibo workspace cp ./project ws-01k…:/srv/project
    kibo workspace cp ws-01k…:/var/log/app.log .
    kibo workspace cp ws-01k…:/etc - | tar tv        (a tar on stdout)
    tar c dir | kibo workspace cp - ws-01k…:/srv    (a tar from stdin)
    kibo workspace cp --user www-data ./site ws-01k…:/var/www
    """
    from kibotos.dataplane.clients.user_name import optional_user_name

    optional_user_name(user, "--user")
    source, destination = parse_side(src), parse_side(dst)
    remotes = [side for side in (source, destination) if isinstance(side, Remote)]
    if len(remotes) != 1:
        raise click.UsageError("exactly one of SRC and DST must be WORKSPACE:PATH (write "
                               "./NAME for a local path with a colon in it)")
    if user is not None and not isinstance(destination, Remote):
        raise InvalidArgument("--user applies to a copy into a Workspace: a copy out of "
                              "it reads as the guest agent's user")
    session: dict[str, Any] = inv.client().post(
        f"/v1/workspaces/{remotes[0].workspace}/sessions", {"operations": ["files"]},
        write=False)
    remaining = inv.deadline.remaining()

    import trio

    from kibotos.dataplane.process.groups import sole_error

    async def main() -> dict[str, Any]:
        with trio.move_on_after(remaining if remaining is not None else float("inf")):
            return await copy(session["dataplane_url"], session["credential"], source,
                              destination, show_progress=sys.stderr.isatty(),
                              ssl_context=inv.dataplane_tls(session["dataplane_url"]),
                              user=user)
        raise DeadlineExceeded(f"the global --timeout of {inv.deadline.seconds:g}s passed; "
                               "the copy was stopped and nothing was left half-written")

    try:
        result = trio.run(main)
    except BaseExceptionGroup as group:  # the one error of a failed copy, out of trio's
        leaf = sole_error(group)
        if leaf is None:
            raise
        raise leaf from None
    if destination == "-":
        return  # stdout is the tar
    if inv.as_json:
        inv.out.json_result(result)
    else:
        inv.out.message(f"copied {result.get('bytes', 0)} bytes ({result.get('sha256', '')})"
                        f" to {result.get('to', destination)}")
