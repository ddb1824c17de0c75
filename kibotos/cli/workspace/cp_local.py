"""The local end of ``kibo workspace cp``: files and tar streams on this machine, fed
to and from trio with bounded memory.

Blocking work (reading and writing local files, packing and unpacking tar with the
guest agent's own `tarstream`, so both ends agree on names, modes, mtimes and symlinks)
runs in worker threads; bytes cross to trio through a memory channel of a few chunks,
which is the back-pressure: a slow data plane stops the local reader, a slow disk stops
the download.  A downloaded file is written to a temporary file beside its target and
renamed into place only after the transfer's digest was checked.
"""

from __future__ import annotations

import errno
import os
from collections.abc import AsyncIterable, Iterator
from contextlib import contextmanager

import trio

from kibotos.core.errors import (
    FailedPrecondition,
    Internal,
    KibotosError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from kibotos.guest.kibotos_guest.services.tarstream import Unpacker, pack

CHUNK = 256 * 1024
#: Chunks in flight between a worker thread and trio.
QUEUE = 4


def local_error(exc: OSError, what: str) -> KibotosError:
    """A local file problem in the CLI's terms (docs/cli.md's exit codes)."""
    text = f"{what}: {exc.strerror or exc}"
    if exc.errno == errno.ENOENT:
        return NotFound(text)
    if exc.errno in (errno.EACCES, errno.EPERM):
        return PermissionDenied(text)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ResourceExhausted(text + " (the local disk is full)",
                                 details={"reason": "no_space"})
    if exc.errno in (errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENOTEMPTY,
                     errno.EROFS):
        return FailedPrecondition(text)
    return Internal(text)


@contextmanager
def local_errors(what: str) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise local_error(exc, what) from None


class FdChunks:
    """A descriptor's bytes (a file, or standard input) in chunks, each read in a
    thread (an iterator object: an upload that stops early leaves nothing to close)."""

    def __init__(self, fd: int, what: str) -> None:
        self.fd = fd
        self.what = what

    def __aiter__(self) -> FdChunks:
        return self

    async def __anext__(self) -> bytes:
        with local_errors(self.what):
            data = await trio.to_thread.run_sync(os.read, self.fd, CHUNK,
                                                 abandon_on_cancel=True)
        if not data:
            raise StopAsyncIteration
        return data


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class _Writer:
    """What `pack` writes to, in the worker thread: whole chunks to the channel."""

    def __init__(self, send: trio.MemorySendChannel[bytes]) -> None:
        self._send = send
        self._pending = bytearray()

    def write(self, data: bytes) -> int:
        self._pending += data
        while len(self._pending) >= CHUNK:
            trio.from_thread.run(self._send.send, bytes(self._pending[:CHUNK]))
            del self._pending[:CHUNK]
        return len(data)

    def close(self) -> None:
        if self._pending:
            trio.from_thread.run(self._send.send, bytes(self._pending))
        trio.from_thread.run_sync(self._send.close)


def pack_tree(nursery: trio.Nursery, source: str, arcname: str
              ) -> trio.MemoryReceiveChannel[bytes]:
    """`source` as a tar stream named `arcname` (symlinks kept, never followed), packed
    in a thread of `nursery`; read the returned channel to its end."""
    send, receive = trio.open_memory_channel[bytes](QUEUE)

    def work() -> None:
        out = _Writer(send)
        with local_errors(f"reading {source}"):
            pack(source, arcname, out)
        out.close()

    nursery.start_soon(trio.to_thread.run_sync, work)
    return receive


class _ChannelReader:
    """A file object over a trio memory channel, for a worker thread."""

    def __init__(self, receive: trio.MemoryReceiveChannel[bytes]) -> None:
        self._receive = receive
        self._buf = b""
        self._eof = False

    def read(self, size: int = -1) -> bytes:
        if not self._buf and not self._eof:
            try:
                self._buf = trio.from_thread.run(self._receive.receive)
            except trio.EndOfChannel:
                self._eof = True
        if size < 0 or size >= len(self._buf):
            data, self._buf = self._buf, b""
        else:
            data, self._buf = self._buf[:size], self._buf[size:]
        return data

    def drain(self) -> None:
        while self.read(CHUNK):
            pass


async def unpack_tree(chunks: AsyncIterable[bytes], dest: str,
                      rename_top: str | None) -> list[str]:
    """Unpack a tar stream into the existing directory `dest` (its top-level entry
    renamed to `rename_top`), through a staging directory that is renamed into place
    only once every chunk arrived (and the iterator checked the digest)."""
    with local_errors(f"writing into {dest}"):
        unpacker = Unpacker(dest, keep_owner=False, rename_top=rename_top)
    send, receive = trio.open_memory_channel[bytes](QUEUE)
    reader = _ChannelReader(receive)

    def extract() -> None:
        with local_errors(f"writing into {dest}"):
            unpacker.extract(reader)  # type: ignore[arg-type]
            reader.drain()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, extract)
            async with send:
                async for chunk in chunks:
                    await send.send(chunk)
        with local_errors(f"writing into {dest}"):
            return await trio.to_thread.run_sync(unpacker.commit)
    except BaseException:
        await trio.to_thread.run_sync(unpacker.discard)
        raise


class LocalFile:
    """A file being downloaded: a temporary file beside `target` until `commit`."""

    def __init__(self, target: str) -> None:
        self.target = target
        directory = os.path.dirname(os.path.abspath(target))
        self.tmp = os.path.join(directory, f".{os.path.basename(target)[:180]}."
                                           f"kibo-{os.urandom(4).hex()}.tmp")
        with local_errors(f"writing {target}"):
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                              0o600)

    async def write(self, data: bytes) -> None:
        with local_errors(f"writing {self.target}"):
            await trio.to_thread.run_sync(write_all, self.fd, data)

    async def commit(self, mode: int, mtime_ns: int) -> None:
        def finish() -> None:
            os.fchmod(self.fd, mode)
            os.utime(self.fd, ns=(mtime_ns, mtime_ns))
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
            os.replace(self.tmp, self.target)
            dfd = os.open(os.path.dirname(os.path.abspath(self.target)), os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

        with local_errors(f"writing {self.target}"):
            await trio.to_thread.run_sync(finish)

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if os.path.lexists(self.tmp):
            os.unlink(self.tmp)
