"""Uploads: ``file_write`` (one file), ``tar_write`` (a tar stream unpacked into a
directory), and the ``transfer_commit`` / ``transfer_cancel`` that end transfers.

The bytes go to a temporary file (a staging directory for a tree) in the target
directory; ``transfer_commit`` checks the digest the host sends, fsyncs and renames
into place, and answers with what was written.  Any failure before that (ENOSPC, a
bad archive, a cancel, the host's session ending) removes the temporary file:
nothing half-written is ever left under the target name.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat

from ..errors import AgentError, field, guest_path, int_field, invalid, user_field
from ..runtime.framing import DATA_CHUNK, DEFAULT_WINDOW, MAX_WINDOW
from ..runtime.sysio import write_stream
from .bridge import Inbound, Transfer, check_digest, stream_id_field, writable
from .fileinfo import Names, lstat_entry
from .fileops import finish_file, fsync_dir, make_parents, owner_fields
from .tarstream import Unpacker, result

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from ..core import Agent
    from ..runtime.channel import Channel
    from ..runtime.tasks import Future

    Body = Callable[[], dict[str, Any]]

_DIGEST = re.compile(r"sha256:[0-9a-fA-F]{64}")


async def _upload(agent: Agent, ch: Channel, msg: dict[str, Any], what: str, path: str,
                  prepare: Body, body: Callable[[Inbound], Body],
                  cleanup: Callable[[], None]) -> dict[str, Any]:
    writable(agent, what)
    window = int_field(msg, "window", 1, MAX_WINDOW, DEFAULT_WINDOW)
    inp = Inbound(ch, stream_id_field(ch, msg), window)
    transfer = Transfer(ch, inp, what, path)

    def cleanup_all() -> None:
        inp.fail()
        cleanup()

    transfer.start(prepare, body(inp), cleanup_all)
    try:
        await transfer.ready
    except AgentError:
        transfer.forget()
        raise

    def ended(done: Future) -> None:
        # A failed upload keeps its stream until the commit or cancel: frames the host
        # sent before it learnt of the failure are discarded (and credited), not errors.
        exc = done.exception()
        if exc is None and ch.streams.get(inp.stream_id) is inp:
            del ch.streams[inp.stream_id]
        if exc is not None and ch.session == inp.session and not inp.committed:
            # The host is still sending: tell it to stop (its commit gets the error too).
            ch.send_control({"type": "transfer_end", "stream": inp.stream_id,
                             "error": exc.to_wire() if isinstance(exc, AgentError) else {
                                 "code": "internal", "message": str(exc)}})

    transfer.done.add_done_callback(ended)
    return {"stream_window": window}


def _digest_field(msg: dict[str, Any]) -> str | None:
    digest: str | None = field(msg, "sha256", str, None)
    if digest is not None and not _DIGEST.fullmatch(digest):
        raise invalid(f"{msg['type']}: sha256 must be 'sha256:' and 64 hex digits")
    return digest


async def file_write(agent: Agent, ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
    path = guest_path(field(msg, "path", str), "file_write: path")
    if path == "/":
        raise invalid("file_write: path must name a file")
    mode = int_field(msg, "mode", 0, 0o7777, None)
    uid, gid = owner_fields(msg)
    mtime_ns = int_field(msg, "mtime_ns", -(2**62), 2**62, None)
    parents = field(msg, "parents", bool, False)
    real = agent.path(path)
    state: dict[str, Any] = {}

    def prepare() -> dict[str, Any]:
        directory = os.path.dirname(real)
        if parents:
            make_parents(directory, uid, gid)
        try:
            state["old"] = os.stat(real)
        except FileNotFoundError:
            state["old"] = None
        if state["old"] is not None and stat.S_ISDIR(state["old"].st_mode):
            raise AgentError("failed_precondition", f"file_write {path}: is a directory",
                             {"reason": "is_directory"})
        tmp = os.path.join(directory, f".{os.path.basename(real)[:180]}.kibotos-"
                                      f"{os.urandom(4).hex()}.tmp")
        state["fd"] = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                              0o600)
        state["tmp"] = tmp
        return {}

    def body(inp: Inbound) -> Body:
        def run() -> dict[str, Any]:
            fd = state["fd"]
            write_stream(fd, inp, DATA_CHUNK)
            check_digest(inp.wait_commit(), inp, "file_write", path)
            finish_file(fd, state["old"], mode, uid, gid, mtime_ns)
            os.fsync(fd)
            os.close(state.pop("fd"))
            os.replace(state["tmp"], real)
            del state["tmp"]
            fsync_dir(os.path.dirname(real))
            return {"bytes": inp.count, "sha256": inp.hexdigest(),
                    "entry": lstat_entry(path, real, "file_write")}
        return run

    def cleanup() -> None:
        if "fd" in state:
            os.close(state.pop("fd"))
        if "tmp" in state:
            os.unlink(state.pop("tmp"))

    return await _upload(agent, ch, msg, "file_write", path, prepare, body, cleanup)


async def tar_write(agent: Agent, ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
    path = guest_path(field(msg, "path", str), "tar_write: path")
    real = agent.path(path)
    named = user_field(msg)
    owner = (named.pw_uid, named.pw_gid) if named is not None else None
    box: list[Unpacker] = []

    def prepare() -> dict[str, Any]:
        if not stat.S_ISDIR(os.stat(real).st_mode):
            raise AgentError("failed_precondition", f"tar_write {path}: not a directory",
                             {"reason": "not_directory"})
        box.append(Unpacker(real, keep_owner=os.geteuid() == 0, owner=owner))
        return {}

    def body(inp: Inbound) -> Body:
        def run() -> dict[str, Any]:
            unpacker = box[0]
            unpacker.extract(inp)  # type: ignore[arg-type]
            while inp.read(DATA_CHUNK):  # the archive's trailing padding: part of the digest
                pass
            check_digest(inp.wait_commit(), inp, "tar_write", path)
            tops = unpacker.commit()
            names = Names()
            return {"bytes": inp.count, "sha256": inp.hexdigest(), **result(unpacker),
                    "entries": [lstat_entry(os.path.join(path, t), os.path.join(real, t),
                                            "tar_write", names) for t in tops[:100]]}
        return run

    def cleanup() -> None:
        if box:
            box[0].discard()

    return await _upload(agent, ch, msg, "tar_write", path, prepare, body, cleanup)


# -------------------------------------------------------------------------- commit, cancel


async def transfer_commit(agent: Agent, ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
    sid = int_field(msg, "stream", 1, 2**32 - 1)
    digest = _digest_field(msg)
    transfer = ch.transfers.get(sid)
    if transfer is None or not isinstance(transfer.bridge, Inbound):
        raise AgentError("not_found", f"transfer_commit: no upload on stream {sid}")
    transfer.bridge.commit(digest)
    try:
        outcome: dict[str, Any] = await transfer.done
    finally:
        transfer.forget()
    return outcome


async def transfer_cancel(agent: Agent, ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
    """Stop a transfer; answered once its temporary files are gone.  A transfer that
    already ended is not an error (the cancel crossed its end)."""
    sid = int_field(msg, "stream", 1, 2**32 - 1)
    transfer = ch.transfers.get(sid)
    if transfer is None:
        return {"cancelled": False}
    transfer.bridge.cancel("cancelled by the host")
    with contextlib.suppress(AgentError):  # its own outcome, or a failure that crossed it
        await transfer.done
    transfer.forget()
    return {"cancelled": True}


