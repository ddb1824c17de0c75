"""Downloads: ``file_read`` (one file's bytes), ``tar_read`` (a path as a tar
stream) and ``file_list`` (a listing, streamed as JSON lines).

Each prepares in its worker thread (a missing path or a permission problem is the
request's error, before any byte moves), then streams under the host's credit and
ends with the data EOF and a ``transfer_end`` event carrying the byte count and
sha256, or with only ``transfer_end`` carrying the error.
"""

from __future__ import annotations

import json
import os
import stat

from ..errors import AgentError, field, guest_path, int_field, invalid
from ..runtime.framing import DATA_CHUNK, DEFAULT_WINDOW, MAX_WINDOW
from .bridge import Outbound, Transfer, stream_id_field
from .fileinfo import Names, entry, lstat_entry
from .fileops import walk
from .tarstream import pack

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from ..core import Agent
    from ..runtime.channel import Channel
    from ..runtime.tasks import Future

    Body = Callable[[], dict[str, Any]]

#: How deep file_list descends at most.
MAX_DEPTH = 64


def cleaned_up(body: Callable[[Outbound], Body], cleanup: Callable[[], None]
               ) -> Callable[[Outbound], Body]:
    """`body`, with `cleanup` run after it however it ends (the descriptors a download
    holds are closed by the worker thread that used them)."""

    def closing(out: Outbound) -> Body:
        run = body(out)

        def wrapped() -> dict[str, Any]:
            try:
                return run()
            finally:
                cleanup()
        return wrapped

    return closing


async def start_download(ch: Channel, msg: dict[str, Any], what: str, path: str,
                         prepare: Callable[[Outbound], Body], body: Callable[[Outbound], Body],
                         cleanup: Callable[[], None], *,
                         outbound: Callable[[Channel, int], Outbound] = Outbound
                         ) -> dict[str, Any]:
    """Run a download's `prepare` then `body` in a worker thread; answered after
    `prepare` (`watches` uses it too, with its own `outbound` stream)."""
    window = int_field(msg, "window", 1, MAX_WINDOW, DEFAULT_WINDOW)
    out = outbound(ch, stream_id_field(ch, msg))
    transfer = Transfer(ch, out, what, path)
    transfer.start(prepare(out), body(out), cleanup)
    try:
        answer: dict[str, Any] = await transfer.ready
    except AgentError:
        transfer.forget()
        raise

    def ended(done: Future) -> None:
        transfer.forget()
        if ch.session != out.session:
            return
        exc = done.exception()
        message: dict[str, Any] = {"type": "transfer_end", "stream": out.stream_id}
        if exc is None:
            message.update(done.result())
        else:
            message["error"] = exc.to_wire() if isinstance(exc, AgentError) else {
                "code": "internal", "message": str(exc)}
        ch.send_control(message)

    transfer.done.add_done_callback(ended)
    out.open(window)  # the answer goes out in this same step, before any data frame
    return answer


async def file_read(agent: Agent, ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
    path = guest_path(field(msg, "path", str), "file_read: path")
    real = agent.path(path)
    fds: list[int] = []

    def prepare(out: Outbound) -> Body:
        def run() -> dict[str, Any]:
            fds.append(os.open(real, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY))
            st = os.fstat(fds[0])
            if stat.S_ISDIR(st.st_mode):
                raise AgentError("failed_precondition", f"file_read {path}: is a directory "
                                 "(read it with tar_read)", {"reason": "is_directory"})
            if not stat.S_ISREG(st.st_mode):
                raise AgentError("failed_precondition", f"file_read {path}: not a regular "
                                 "file", {"reason": "not_regular"})
            return {"entry": entry(path, real, st, Names())}
        return run

    def body(out: Outbound) -> Body:
        def run() -> dict[str, Any]:
            while True:
                chunk = os.read(fds[0], DATA_CHUNK)
                if not chunk:
                    break
                out.write(chunk)
            out.finish()
            return {"bytes": out.count, "sha256": out.hexdigest()}
        return run

    def cleanup() -> None:
        while fds:
            os.close(fds.pop())

    return await start_download(ch, msg, "file_read", path, prepare,
                                cleaned_up(body, cleanup), cleanup)


def _arcname(msg: dict[str, Any], path: str) -> str:
    name = field(msg, "arcname", str, None)
    if name is None:
        return os.path.basename(path) or "."
    if not name or "/" in name or name == ".." or "\0" in name:
        raise invalid(f"tar_read: arcname must be one path component, got {name!r}")
    return str(name)


async def tar_read(agent: Agent, ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
    path = guest_path(field(msg, "path", str), "tar_read: path")
    arcname = _arcname(msg, path)
    real = agent.path(path)

    def prepare(out: Outbound) -> Body:
        return lambda: {"entry": lstat_entry(path, real, "tar_read"), "arcname": arcname}

    def body(out: Outbound) -> Body:
        def run() -> dict[str, Any]:
            members = pack(real, arcname, out)
            out.finish()
            return {"bytes": out.count, "sha256": out.hexdigest(), "members": members}
        return run

    return await start_download(ch, msg, "tar_read", path, prepare, body, lambda: None)


async def file_list(agent: Agent, ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
    path = guest_path(field(msg, "path", str), "file_list: path")
    depth = int_field(msg, "depth", 1, MAX_DEPTH, 1)
    real = agent.path(path)
    names = Names()

    def prepare(out: Outbound) -> Body:
        def run() -> dict[str, Any]:
            top = lstat_entry(path, real, "file_list", names)
            if top["type"] != "directory":
                raise AgentError("failed_precondition", f"file_list {path}: not a directory",
                                 {"reason": "not_directory"})
            return {"entry": top}
        return run

    def body(out: Outbound) -> Body:
        def run() -> dict[str, Any]:
            counts = {"entries": 0, "unreadable": 0}
            walk(path, real, depth, names, counts,
                         lambda e: out.write(json.dumps(e, separators=(",", ":")).encode()
                                             + b"\n"))
            out.finish()
            return {"bytes": out.count, "sha256": out.hexdigest(), **counts}
        return run

    return await start_download(ch, msg, "file_list", path, prepare, body, lambda: None)


