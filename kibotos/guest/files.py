"""The host end of the guest's ``files`` requests: metadata operations, and uploads and
downloads as trio streams under the guest protocol's credit (docs/guest-protocol.md,
"Files").

::

    files = guest.files                      # FailedPrecondition if the agent lacks "files"
    entry = await files.stat("/etc/hostname")
    async with await files.open_read("/var/log/syslog") as down:
        async for chunk in down.stream: ...
        done = await down.result()          # byte count and the guest's sha256
    async with await files.open_write("/srv/a.bin", mode=0o644) as up:
        await up.stream.send_all(data)
        done = await up.commit(sha256)       # checked by the guest before the rename

A download or upload left without `result` / `commit` (an exception, a cancellation)
is cancelled in the guest, which removes its temporary files.
"""

from __future__ import annotations

import contextlib
import dataclasses
from types import TracebackType
from typing import TYPE_CHECKING, Any

import trio

from kibotos.core.errors import FailedPrecondition, Internal, KibotosError, error_of
from kibotos.guest.kibotos_guest.runtime.framing import DEFAULT_WINDOW, MAX_PAYLOAD
from kibotos.guest.streams import GuestInputStream, GuestOutputStream

if TYPE_CHECKING:
    from kibotos.guest.client import GuestChannel

#: How long a cancel on the way out may take before the channel is left to clean up.
CANCEL_TIMEOUT = 10.0


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """A path as the guest describes it (``lstat``: a symlink is not followed)."""

    name: str
    path: str
    type: str  # file | directory | symlink | other
    size: int
    mode: int
    permissions: str
    owner: str
    group: str
    uid: int
    gid: int
    mtime_ns: int
    modified_time: str
    symlink_target: str | None = None

    @classmethod
    def from_wire(cls, body: Any) -> FileEntry:
        if not isinstance(body, dict):
            raise Internal(f"the guest sent a file entry that is not an object: {body!r}")
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            value = body.get(f.name)
            kind = int if f.type == "int" else str
            if f.name == "symlink_target" and value is None:
                continue
            if not isinstance(value, kind) or isinstance(value, bool):
                raise Internal(f"the guest sent a file entry whose {f.name} is {value!r}")
            values[f.name] = value
        return cls(**values)

    def to_wire(self) -> dict[str, Any]:
        body = dataclasses.asdict(self)
        if self.symlink_target is None:
            del body["symlink_target"]
        return body


@dataclasses.dataclass(frozen=True)
class TransferResult:
    """How a transfer ended: its bytes and their sha256 (``sha256:<hex>``) as the guest
    counted them, and the rest of the guest's answer (`body`)."""

    bytes: int
    sha256: str
    body: dict[str, Any]

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> TransferResult:
        count, digest = body.get("bytes"), body.get("sha256")
        if not isinstance(count, int) or not isinstance(digest, str):
            raise Internal(f"the guest's transfer result has no bytes and sha256: {body!r}")
        return cls(count, digest, body)

    @property
    def entry(self) -> FileEntry | None:
        raw = self.body.get("entry")
        return FileEntry.from_wire(raw) if raw is not None else None


class _Transfer:
    """What downloads and uploads share: the stream ID, the end, the cancel."""

    def __init__(self, channel: GuestChannel, stream_id: int) -> None:
        self._channel = channel
        self.stream_id = stream_id
        self._ended = trio.Event()
        self._result: TransferResult | None = None
        self._error: KibotosError | None = None
        self._settled = False

    def _end(self, message: dict[str, Any]) -> None:
        """The guest's ``transfer_end`` (or the channel's failure, as a message)."""
        error = message.get("error")
        if isinstance(error, dict):
            self._error = error_of(error)
        else:
            try:
                self._result = TransferResult.from_wire(message)
            except KibotosError as exc:
                self._error = exc
        self._ended.set()

    def _fail(self, error: KibotosError) -> None:
        if not self._ended.is_set():
            self._error = error
            self._ended.set()

    async def cancel(self) -> None:
        """Stop it in the guest; returns once the guest removed what it had written."""
        if self._settled:
            return
        self._settled = True
        await self._stop_local()
        if self._channel.error is None:
            await self._channel._request("transfer_cancel", {"stream": self.stream_id})

    def _forget_stream(self) -> None:
        raise NotImplementedError

    async def _stop_local(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if not self._settled:
            # A channel that went away ends the guest's session, which cleans up too.
            with trio.move_on_after(CANCEL_TIMEOUT, shield=True), \
                    contextlib.suppress(KibotosError):
                await self.cancel()


class Download(_Transfer):
    """Bytes from the guest on `stream`; `result` after it reached EOF."""

    def __init__(self, channel: GuestChannel, stream_id: int, window: int) -> None:
        super().__init__(channel, stream_id)
        self.stream = GuestOutputStream(channel, stream_id, window)
        self.answer: dict[str, Any] = {}

    @property
    def entry(self) -> FileEntry:
        return FileEntry.from_wire(self.answer.get("entry"))

    def _fail(self, error: KibotosError) -> None:
        super()._fail(error)
        self.stream._fail(error)

    def _end(self, message: dict[str, Any]) -> None:
        super()._end(message)
        if self._error is not None:
            self.stream._fail(self._error)
            self._channel._outputs.pop(self.stream_id, None)

    def _forget_stream(self) -> None:
        self._channel._outputs.pop(self.stream_id, None)

    async def _stop_local(self) -> None:
        # Frames already on their way are dropped (and credited) by the closed stream
        # until the guest's transfer_end, which forgets both.
        await self.stream.aclose()

    async def result(self) -> TransferResult:
        """The guest's count and digest, once it sent everything (read `stream` to its
        end first: it is not buffered beyond its window)."""
        await self._ended.wait()
        self._settled = True
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class Upload(_Transfer):
    """Bytes to the guest on `stream`; `commit` puts them in place."""

    def __init__(self, channel: GuestChannel, stream_id: int) -> None:
        super().__init__(channel, stream_id)
        # frames as large as the protocol allows (as a port's): a quarter of the
        # frames, CRCs and wake-ups in the agent of 64 KiB ones
        self.stream = GuestInputStream(channel, stream_id, False, chunk=MAX_PAYLOAD)

    def _fail(self, error: KibotosError) -> None:
        super()._fail(error)
        self.stream._fail(error)

    def _end(self, message: dict[str, Any]) -> None:  # only ever an error, mid-upload
        super()._end(message)
        if self._error is not None:
            self.stream._fail(self._error)

    def _forget_stream(self) -> None:
        self._channel._inputs.pop(self.stream_id, None)

    async def _stop_local(self) -> None:
        self._channel._transfers.pop(self.stream_id, None)
        self._forget_stream()
        await trio.lowlevel.checkpoint()

    @property
    def error(self) -> KibotosError | None:
        """Why the guest stopped taking bytes, once it did (ENOSPC and the like)."""
        return self._error

    async def commit(self, sha256: str | None = None) -> TransferResult:
        """End of input: the guest checks `sha256` (``sha256:<hex>``, when given),
        makes the bytes durable and renames them into place."""
        if self._error is not None:
            self._settled = True
            raise self._error
        self._settled = True
        fields: dict[str, Any] = {"stream": self.stream_id}
        if sha256 is not None:
            fields["sha256"] = sha256
        try:
            body = await self._channel._request("transfer_commit", fields)
        finally:
            self._channel._transfers.pop(self.stream_id, None)
            self._forget_stream()
        return TransferResult.from_wire(body)


class GuestFiles:
    """The ``files`` requests of one channel (`GuestChannel.files`)."""

    def __init__(self, channel: GuestChannel) -> None:
        self._channel = channel

    async def _call(self, kind: str, fields: dict[str, Any]) -> dict[str, Any]:
        await self._channel.require("files")
        body: dict[str, Any] = await self._channel._request(kind, fields)
        return body

    async def stat(self, path: str) -> FileEntry:
        return FileEntry.from_wire((await self._call("file_stat", {"path": path}))["entry"])

    async def mkdir(self, path: str, *, parents: bool = True, mode: int = 0o755,
                    uid: int | None = None, gid: int | None = None,
                    user: str | None = None) -> tuple[FileEntry, bool]:
        """The directory, and whether it was created (False: it existed already).
        `user` (a name) owns it and the parents it made."""
        body = await self._call("file_mkdir", {
            "path": path, "parents": parents, "mode": mode, "uid": uid, "gid": gid,
            **await user_fields(self._channel, user)})
        return FileEntry.from_wire(body["entry"]), body.get("created") is True

    async def move(self, source: str, destination: str) -> FileEntry:
        body = await self._call("file_move", {"source": source, "destination": destination})
        return FileEntry.from_wire(body["entry"])

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._call("file_remove", {"path": path, "recursive": recursive})

    async def _open_download(self, kind: str, fields: dict[str, Any],
                             window: int) -> Download:
        await self._channel.require("files")
        channel = self._channel
        sid = channel._new_stream_id()
        down = Download(channel, sid, window)
        channel._outputs[sid] = down.stream
        channel._transfers[sid] = down
        try:
            down.answer = await channel._request(kind, {**fields, "stream": sid,
                                                        "window": window})
        except BaseException:
            channel._outputs.pop(sid, None)
            channel._transfers.pop(sid, None)
            raise  # (a cancelled request's transfer ends with the session, or runs out)
        return down

    async def open_read(self, path: str, *, window: int = DEFAULT_WINDOW) -> Download:
        """One regular file's bytes; `Download.entry` is its fstat at open."""
        return await self._open_download("file_read", {"path": path}, window)

    async def open_tar_read(self, path: str, *, arcname: str | None = None,
                            window: int = DEFAULT_WINDOW) -> Download:
        """`path` (a file, symlink or tree) as a tar stream, named `arcname`
        (default: its last component)."""
        return await self._open_download("tar_read", {"path": path, "arcname": arcname},
                                         window)

    async def open_list(self, path: str, *, depth: int = 1,
                        window: int = DEFAULT_WINDOW) -> Download:
        """The entries under a directory as JSON lines, down to `depth` levels."""
        return await self._open_download("file_list", {"path": path, "depth": depth}, window)

    async def open_watch(self, path: str, *, recursive: bool = False,
                         window: int = DEFAULT_WINDOW) -> Download:
        """The changes in the directory `path` (below it too, `recursive`) as JSON
        lines ``{name, type}`` (or ``{"type": "overflow"}``: events were lost), until
        the download is closed (which cancels the watch) or the directory goes.  The
        watch is set when this returns: every later change is on the stream."""
        await self._channel.require("files.watch")
        return await self._open_download("file_watch", {"path": path,
                                                        "recursive": recursive}, window)

    async def list(self, path: str, *, depth: int = 1) -> list[FileEntry]:
        """All entries (for listings that fit in memory; `open_list` streams)."""
        import json

        async with await self.open_list(path, depth=depth) as down:
            data = await down.stream.read_all()
            await down.result()
        return [FileEntry.from_wire(json.loads(line)) for line in data.splitlines() if line]

    async def _open_upload(self, kind: str, fields: dict[str, Any]) -> Upload:
        await self._channel.require("files")
        channel = self._channel
        sid = channel._new_stream_id()
        up = Upload(channel, sid)
        channel._inputs[sid] = up.stream
        channel._transfers[sid] = up
        try:
            body = await channel._request(kind, {**fields, "stream": sid})
        except BaseException:
            channel._inputs.pop(sid, None)
            channel._transfers.pop(sid, None)
            raise
        up.stream._add_credit(int(body.get("stream_window", 0)))
        return up

    async def open_write(self, path: str, *, mode: int | None = None, uid: int | None = None,
                         gid: int | None = None, mtime_ns: int | None = None,
                         parents: bool = False, window: int = DEFAULT_WINDOW,
                         user: str | None = None) -> Upload:
        """Write one file: the bytes go to a temporary file beside `path` until
        `Upload.commit`.  Unset `mode`/owner keep an existing file's (else 0644);
        `user` (a name) owns the file and the parents it made."""
        return await self._open_upload("file_write", {
            "path": path, "mode": mode, "uid": uid, "gid": gid, "mtime_ns": mtime_ns,
            "parents": parents, "window": window, **await user_fields(self._channel, user)})

    async def open_tar_write(self, path: str, *, window: int = DEFAULT_WINDOW,
                             user: str | None = None) -> Upload:
        """Unpack a tar stream into the existing directory `path` (staged, then merged
        in on `Upload.commit`).  `window`: how much the guest buffers for it; `user`
        (a name) owns everything it creates."""
        return await self._open_upload("tar_write", {
            "path": path, "window": window, **await user_fields(self._channel, user)})


def require_capability(channel: GuestChannel, capability: str) -> None:
    hello = channel.hello
    if hello is not None and capability not in hello.capabilities:
        raise FailedPrecondition(
            f"the guest agent ({hello.agent_version or 'unknown version'}) has no "
            f"{capability!r} capability: rebuild the Template with this kibotos's agent",
            details={"capability": capability, "agent_version": hello.agent_version})


#: The capability of an agent that takes a ``user`` name on exec and file writes, and
#: the first agent version that has it (named in the refusal, so the fix is plain).
USER_NAMES_CAPABILITY = "user_names"
USER_NAMES_AGENT_VERSION = "0.6.0"


async def user_fields(channel: GuestChannel, user: str | None) -> dict[str, Any]:
    """The request fields that ask the guest to act as `user` (a name).

    An older agent ignores a field it does not know, so a name it cannot honour must
    be refused here rather than silently run as root: FailedPrecondition naming the
    agent version needed.  ``root`` is what such an agent does anyway, so it is
    served there without the field."""
    if user is None:
        return {}
    await channel._hello_event.wait()
    hello = channel.hello
    if hello is not None and USER_NAMES_CAPABILITY not in hello.capabilities:
        if user == "root":
            return {}
        raise FailedPrecondition(
            f"running as user {user!r} needs guest agent {USER_NAMES_AGENT_VERSION} or later "
            f"(this guest has {hello.agent_version or 'an unknown version'}): rebuild the "
            "Template with this kibotos's agent",
            details={"capability": USER_NAMES_CAPABILITY, "user": user,
                     "agent_version": hello.agent_version,
                     "needs_agent_version": USER_NAMES_AGENT_VERSION})
    return {"user": user}
