"""One guest channel per Instance, shared by every connection that reaches that guest.

The data plane talks to a guest over the VMM's second agent port (``org.kibotos.agent.1``,
host socket ``agent-dp.sock`` in the Instance directory), separate from the node's port,
so the two never reset each other's sessions.  A virtio-serial port takes one host
connection at a time, and a new connection starts a new guest session (the agent hangs
up what the previous one had open), so every exec to one guest must share one channel:
`GuestPool` opens it on first use, keeps it while it works, and opens a fresh one on
the next use after it ended (the guest restarted, the VMM went away).  A target that
leaves the node's state is closed, which hangs up its processes in the guest.
"""

from __future__ import annotations

from pathlib import Path

import trio

from kibotos.core.errors import KibotosError, Unavailable
from kibotos.core.logs import EventLogger
from kibotos.dataplane.process.groups import kibotos_leaf
from kibotos.guest import GuestChannel, connect_unix_with_retry, open_guest_channel
from kibotos.guest.vsock import connect_vsock

log = EventLogger("kibotos.dataplane")

#: How long the first use of a guest waits for its socket and the agent's hello.
CONNECT_TIMEOUT = 10.0


class _Holder:
    """Holds one channel open in a background task until it ends or is retired."""

    def __init__(self, instance_id: str, agent_socket: Path, timeout: float,
                 vsock_port: int | None = None) -> None:
        self.instance_id = instance_id
        self.agent_socket = agent_socket
        self.vsock_port = vsock_port
        self.timeout = timeout
        self.channel: GuestChannel | None = None
        self.error: KibotosError | None = None
        self.settled = trio.Event()
        self.ended = False
        self.scope = trio.CancelScope()

    async def run(self) -> None:
        with self.scope:
            try:
                deadline = trio.current_time() + self.timeout
                if self.vsock_port is None:
                    stream = await connect_unix_with_retry(self.agent_socket, deadline)
                else:
                    stream = await connect_vsock(self.agent_socket, self.vsock_port,
                                                 deadline)
                async with open_guest_channel(stream) as channel:
                    await channel.wait_hello(deadline)
                    self.channel = channel
                    self.settled.set()
                    log.info("guest channel open", instance_id=self.instance_id,
                             socket=self.agent_socket)
                    why = await channel.wait_closed()
                    log.info("guest channel ended", instance_id=self.instance_id,
                             reason=why.message)
            except KibotosError as exc:
                self.error = exc
            except BaseExceptionGroup as group:  # wait_hello's error, from the nursery
                leaf = kibotos_leaf(group)
                if leaf is None:
                    raise
                self.error = leaf
            finally:
                self.ended = True
                self.settled.set()
        if self.scope.cancelled_caught:
            self.error = self.error or Unavailable(
                f"Instance {self.instance_id} is no longer served by this data plane")

    def usable(self, agent_socket: Path, vsock_port: int | None) -> bool:
        return not self.ended and (agent_socket, vsock_port) == (
            self.agent_socket, self.vsock_port) and (
            self.channel is None or self.channel.error is None)


class GuestPool:
    """Channels to the guests of the current targets; `run` hosts their tasks."""

    def __init__(self, *, connect_timeout: float = CONNECT_TIMEOUT) -> None:
        self.connect_timeout = connect_timeout
        self._holders: dict[str, _Holder] = {}
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def channel(self, instance_id: str, agent_socket: Path,
                      vsock_port: int | None = None) -> GuestChannel:
        """The open channel to this guest, opening one if needed (through the vsock
        handshake when `vsock_port` is set); `Unavailable` when the guest cannot be
        reached within the connect timeout."""
        assert self._nursery is not None, "GuestPool.run is not running"
        holder = self._holders.get(instance_id)
        if holder is None or not holder.usable(agent_socket, vsock_port):
            if holder is not None:
                holder.scope.cancel()
            holder = _Holder(instance_id, agent_socket, self.connect_timeout, vsock_port)
            self._holders[instance_id] = holder
            self._nursery.start_soon(holder.run)
        await holder.settled.wait()
        if holder.channel is not None and holder.channel.error is None:
            return holder.channel
        if self._holders.get(instance_id) is holder:
            del self._holders[instance_id]
        why = holder.error or (holder.channel.error if holder.channel else None)
        raise Unavailable(f"the guest of Instance {instance_id} cannot be reached on "
                          f"{agent_socket}: {why.message if why else 'channel closed'}")

    def retain_only(self, instance_ids: set[str]) -> None:
        """Close the channels of Instances that are no longer targets."""
        for iid in list(self._holders):
            if iid not in instance_ids:
                self._holders.pop(iid).scope.cancel()

    def open_count(self) -> int:
        return sum(1 for h in self._holders.values() if h.channel is not None and not h.ended)
