"""A small trio client of systemd's D-Bus API (org.freedesktop.systemd1), on jeepney.

One `SystemdBus` is one connection to a message bus (the system bus in production; in
tests a user manager's session bus), opened with ``async with systemd_bus(address)``
and closed when the block ends.  The supervisor opens one per operation: systemd or the
bus daemon may restart between two calls of a long-running node, and a fresh connection
never carries a stale state.  Opening one costs a few milliseconds.

D-Bus errors are translated here, at the boundary (`kibotos.sdk` errors): callers see
`DBusError` with the error's name and message, or `Unavailable` when the bus cannot be
reached at all.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio
from jeepney import DBusAddress, MatchRule, MessageType, new_method_call
from jeepney.bus_messages import message_bus
from jeepney.io.common import RouterClosed
from jeepney.io.trio import DBusRouter, open_dbus_router
from jeepney.low_level import HeaderFields, Message

from kibotos.sdk import Unavailable

#: Where the system bus listens unless ``DBUS_SYSTEM_BUS_ADDRESS`` says otherwise.
DEFAULT_SYSTEM_BUS = "unix:path=/run/dbus/system_bus_socket"
SYSTEMD = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
UNIT = "org.freedesktop.systemd1.Unit"
SERVICE = "org.freedesktop.systemd1.Service"
PROPERTIES = "org.freedesktop.DBus.Properties"
#: Error names callers branch on.
NO_SUCH_UNIT = "org.freedesktop.systemd1.NoSuchUnit"
UNIT_EXISTS = "org.freedesktop.systemd1.UnitExists"
UNKNOWN_OBJECT = "org.freedesktop.DBus.Error.UnknownObject"
#: How long one method call may take before the bus counts as unresponsive.
CALL_TIMEOUT = 60.0


def system_bus_address(explicit: str | None = None) -> str:
    """The bus to talk to: an explicit address (the supervisor's ``bus`` option), else
    ``DBUS_SYSTEM_BUS_ADDRESS``, else the standard system bus socket."""
    return explicit or os.environ.get("DBUS_SYSTEM_BUS_ADDRESS") or DEFAULT_SYSTEM_BUS


class DBusError(Exception):
    """An error reply; ``name`` is the D-Bus error name (``org.freedesktop…``)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}" if message else name)
        self.name = name
        self.message = message


def _raise_for_error(reply: Message) -> None:
    if reply.header.message_type == MessageType.error:
        name = str(reply.header.fields.get(HeaderFields.error_name, "unknown"))
        body = reply.body
        message = str(body[0]) if body and isinstance(body[0], str) else ""
        raise DBusError(name, message)


def unwrap_variants(props: Mapping[str, tuple[str, Any]]) -> dict[str, Any]:
    """``a{sv}`` as jeepney returns it (name → (signature, value)) → name → value."""
    return {name: value for name, (_sig, value) in props.items()}


class SystemdBus:
    """Method calls to systemd over one open router (see `systemd_bus`)."""

    def __init__(self, router: DBusRouter, address: str) -> None:
        self.router = router
        self.address = address

    async def call(self, path: str, interface: str, method: str, signature: str | None = None,
                   body: Sequence[Any] = ()) -> tuple[Any, ...]:
        msg = new_method_call(DBusAddress(path, bus_name=SYSTEMD, interface=interface),
                              method, signature, tuple(body))
        try:
            with trio.fail_after(CALL_TIMEOUT):
                reply = await self.router.send_and_get_reply(msg)
        except trio.TooSlowError:
            raise Unavailable(f"systemd did not answer {interface}.{method} on "
                              f"{self.address} within {CALL_TIMEOUT:.0f}s") from None
        except (RouterClosed, trio.BrokenResourceError, trio.ClosedResourceError,
                OSError) as exc:
            raise Unavailable(f"D-Bus connection {self.address} lost during "
                              f"{interface}.{method}: {exc!r}") from None
        _raise_for_error(reply)
        return tuple(reply.body)

    async def manager(self, method: str, signature: str | None = None,
                      body: Sequence[Any] = ()) -> tuple[Any, ...]:
        return await self.call(MANAGER_PATH, MANAGER, method, signature, body)

    async def get_all(self, path: str, interface: str) -> dict[str, Any]:
        (props,) = await self.call(path, PROPERTIES, "GetAll", "s", (interface,))
        return unwrap_variants(props)

    async def subscribe_job_removed(self) -> trio.MemoryReceiveChannel[Message]:
        """Ask the bus and systemd for ``JobRemoved`` signals; returns the channel they
        arrive on.  Call before starting a job, so its end cannot be missed."""
        rule = MatchRule(type="signal", interface=MANAGER, member="JobRemoved",
                         path=MANAGER_PATH)
        send, receive = trio.open_memory_channel[Message](4096)
        # The handle stays registered as long as the router (the connection) lives.
        self.router.filter(rule, channel=send)
        reply = await self.router.send_and_get_reply(message_bus.AddMatch(rule))
        _raise_for_error(reply)
        await self.manager("Subscribe")
        return receive


@asynccontextmanager
async def systemd_bus(address: str) -> AsyncIterator[SystemdBus]:
    """A connection to the bus at `address`; `Unavailable` if it cannot be opened.

    jeepney's router runs its receiver in a nursery, which wraps whatever the block
    raises in an exception group; a lone exception is unwrapped again, so callers see
    `AlreadyExists` rather than a group holding it."""
    try:
        async with contextlib.AsyncExitStack() as stack:
            try:
                router = await stack.enter_async_context(open_dbus_router(address))
            except (OSError, trio.BrokenResourceError, ValueError, StopIteration) as exc:
                raise Unavailable(f"cannot connect to the D-Bus bus {address}: {exc}"
                                  ) from None
            yield SystemdBus(router, address)
    except BaseExceptionGroup as group:
        sole = _sole_exception(group)
        if sole is None:
            raise
        raise sole from None


def _sole_exception(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        if len(exc.exceptions) != 1:
            return None
        exc = exc.exceptions[0]
    return exc
