"""The agent's shared state (processes, configuration, frozen file systems) and the
dispatch of requests to their handlers.

Requests are answered by handlers in `processes`, `configure`, `stop`, `transfers`
(files) and `ports`.  All but the first are imported on their first request: nothing
they need is on the way to the first hello, which is what a booting guest waits for.
"""

from __future__ import annotations

import os
import signal
import time

from . import AGENT_VERSION, CAPABILITIES, FILE_REQUESTS, PROTOCOL_VERSION
from .errors import AgentError, invalid
from .log import log
from .runtime.loop import get_loop
from .runtime.sysio import read_boot_id
from .runtime.tasks import Lock, create_task
from .services import processes

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine
    from typing import Any

    from .runtime.channel import Channel
    from .runtime.loop import Handle
    from .runtime.tasks import Event, Task

    Result = dict[str, Any]
    Handler = Callable[[Channel, Result], Result | Coroutine[Any, Any, Result]]


class Agent:
    """The state shared by every channel: processes, configuration, frozen file systems."""

    def __init__(self, *, root: str = "/", protocol_version: int = PROTOCOL_VERSION) -> None:
        self.root = os.path.realpath(root)
        self.protocol_version = protocol_version
        self.boot_id = read_boot_id()
        self.instance_id = os.urandom(8).hex()
        self.processes: dict[int, processes.ManagedProcess] = {}
        self.by_pid: dict[int, processes.ManagedProcess] = {}
        self.sessions: set[int] = set()
        self.channels: set[Channel] = set()
        self.config: dict[str, Any] = {}
        self.config_digest: str | None = None
        self.env_defaults: dict[str, str] = {}
        self.frozen: dict[str, int] = {}
        self.stopping = False
        self.stop_when_idle: Event | None = None
        self.next_process = 0
        self.config_lock = Lock()
        self._tasks: set[Task] = set()
        self._prune: Handle | None = None
        self._handlers: dict[str, Handler] = {
            "guest_info": lambda ch, msg: self.hello(),
            "ping": lambda ch, msg: {"monotonic": time.monotonic()},
            "exec": lambda ch, msg: processes.exec_request(self, ch, msg),
            "signal": lambda ch, msg: processes.signal_request(self, msg),
            "resize": lambda ch, msg: processes.resize_request(self, msg),
            "configure": self._configure,
            "stop_prepare": self._stop_prepare, "sync": self._sync, "thaw": self._thaw,
        }
        for name in FILE_REQUESTS:
            self._handlers[name] = self._files
        for name in ("port_open", "port_close"):
            self._handlers[name] = self._ports

    def hello(self) -> dict[str, Any]:
        return {"protocol_version": self.protocol_version, "agent_version": AGENT_VERSION,
                "boot_id": self.boot_id, "capabilities": list(CAPABILITIES),
                "instance_id": self.instance_id, "pid": os.getpid(),
                "config_digest": self.config_digest, "stopping": self.stopping,
                "frozen_filesystems": sorted(self.frozen)}

    def path(self, guest_path: str) -> str:
        """Where a guest path lives: under --root in tests, itself in a guest."""
        return guest_path if self.root == "/" else os.path.join(self.root, guest_path.lstrip("/"))

    # -- channels and dispatch

    def add_channel(self, ch: Channel) -> None:
        self.channels.add(ch)
        ch.start()

    def channel_closed(self, ch: Channel) -> None:
        self.channels.discard(ch)
        if not self.channels and self.stop_when_idle is not None:
            self.stop_when_idle.set()

    def dispatch(self, ch: Channel, msg: dict[str, Any]) -> None:
        mtype = msg["type"]
        if mtype == "window":
            stream = ch.streams.get(msg.get("stream"))  # type: ignore[arg-type]
            amount = msg.get("bytes")
            credit = getattr(stream, "credit", None)  # output streams take credit
            if not isinstance(amount, int) or isinstance(amount, bool) or amount <= 0:
                ch.protocol_error("window: 'bytes' must be a positive integer")
            elif credit is not None:
                try:
                    credit(amount)
                except AgentError as e:
                    ch.protocol_error(e.message, stream=msg.get("stream"))
            return  # credit for a stream that just ended is not an error
        if mtype == "hello_request":
            ch.new_session()
            ch.send_control({"type": "hello", **self.hello()})
            return
        rid = msg.get("id")
        if not isinstance(rid, int) or isinstance(rid, bool) or rid < 0:
            ch.protocol_error(f"request {mtype!r} has no non-negative integer 'id'")
            return
        session = ch.session
        handler = self._handlers.get(mtype)
        try:
            if handler is None:
                raise invalid(f"unknown request type {mtype!r}")
            outcome = handler(ch, msg)
        except Exception as e:
            self._respond(ch, session, rid, e)
            return
        if isinstance(outcome, dict):
            self._respond(ch, session, rid, outcome)
            return
        task = create_task(self._finish(ch, session, rid, outcome))
        self._tasks.add(task)
        task.add_done_callback(lambda done: self._tasks.discard(task))

    async def _finish(self, ch: Channel, session: int, rid: int,
                      work: Coroutine[Any, Any, dict[str, Any]]) -> None:
        try:
            result: dict[str, Any] | Exception = await work
        except Exception as e:
            result = e
        self._respond(ch, session, rid, result)

    def _respond(self, ch: Channel, session: int, rid: int,
                 outcome: dict[str, Any] | Exception) -> None:
        if ch.session != session:
            return  # the host that asked has gone; its successor did not ask
        if isinstance(outcome, dict):
            ch.send_control({"type": "response", "id": rid, "result": outcome})
            return
        if not isinstance(outcome, AgentError):
            log.error("request %s failed", rid, exc_info=outcome)
            outcome = AgentError("internal", f"{type(outcome).__name__}: {outcome}")
        ch.send_control({"type": "response", "id": rid, "error": outcome.to_wire()})

    def detach_session(self, ch: Channel) -> None:
        """The host of `ch` has gone: close its streams, hang up its processes."""
        for stream in list(ch.streams.values()):
            stream.detach()
        ch.streams.clear()
        for transfer in list(ch.transfers.values()):
            transfer.bridge.detach()  # its thread cleans up and ends
        ch.transfers.clear()
        for proc in list(self.processes.values()):
            if proc.channel is ch:
                proc.channel = None
                if proc.on_detach == "hangup":
                    for sig in (signal.SIGHUP, signal.SIGCONT):
                        try:
                            os.killpg(proc.pid, sig)
                        except OSError:
                            break  # the group is gone

    def shutdown(self) -> None:
        for ch in list(self.channels):
            ch.close()

    # -- processes

    def reap(self) -> None:
        """SIGCHLD: collect every exited child, ours or orphans handed to us."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            proc = self.by_pid.pop(pid, None)
            if proc is not None:
                self._on_exit(proc, status)

    def _on_exit(self, proc: processes.ManagedProcess, status: int) -> None:
        proc.exited = True
        fields = processes.exit_fields(status)
        sig = fields["signal"]
        proc.popen.returncode = fields["exit_code"] if sig is None else -sig
        self.processes.pop(proc.process_id, None)
        if proc.master_fd >= 0:
            os.close(proc.master_fd)
            proc.master_fd = -1
        ch = proc.channel
        if ch is not None and ch.session == proc.session:
            ch.send_control({"type": "exit", "process": proc.process_id, "pid": proc.pid, **fields})
        if self._prune is None:  # forget sessions that have no members left, soon
            self._prune = get_loop().call_later(1.0, self._prune_sessions)

    def _prune_sessions(self) -> None:
        self._prune = None
        processes.members(self)

    # -- handlers whose modules load on first use

    def _configure(self, ch: Channel, msg: dict[str, Any]
                   ) -> Coroutine[Any, Any, dict[str, Any]]:
        from .configure import configure_request

        return configure_request(self, msg)

    def _stop_prepare(self, ch: Channel, msg: dict[str, Any]
                      ) -> Coroutine[Any, Any, dict[str, Any]]:
        from .stop import stop_prepare_request

        return stop_prepare_request(self, msg)

    def _sync(self, ch: Channel, msg: dict[str, Any]) -> Coroutine[Any, Any, dict[str, Any]]:
        from .stop import sync_request

        return sync_request(msg)

    def _files(self, ch: Channel, msg: dict[str, Any]) -> Coroutine[Any, Any, dict[str, Any]]:
        from .services.transfers import REQUESTS

        return REQUESTS[msg["type"]](self, ch, msg)

    def _ports(self, ch: Channel, msg: dict[str, Any]
               ) -> dict[str, Any] | Coroutine[Any, Any, dict[str, Any]]:
        from .services.ports import port_close, port_open

        if msg["type"] == "port_close":
            return port_close(self, ch, msg)
        return port_open(self, ch, msg)

    def _thaw(self, ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
        from .stop import thaw_request

        return thaw_request(self)
