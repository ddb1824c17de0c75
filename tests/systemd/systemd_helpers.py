"""Helpers of the systemd tests, in a module of their own name (a bare ``from conftest
import`` picks whichever conftest pytest imported first): the supervisor a (re)started
node builds, and a raw D-Bus reader to check what systemd holds."""

from __future__ import annotations

from typing import Any

from jeepney import DBusAddress, MessageType, new_method_call
from jeepney.io.blocking import open_dbus_connection
from usersystemd import UserSystemd

from kibotos.backends import Supervisor
from kibotos.plugins import load_plugins


def new_supervisor(manager: UserSystemd) -> Supervisor:
    """What a (re)started node builds from ``[supervisor] backend = "systemd"``."""
    cls = load_plugins().supervisor.get("systemd")
    return cls({"bus": manager.bus})


class Raw:
    """systemd's own answers, read with a plain blocking jeepney connection (not the
    supervisor's code), so the tests compare against an independent reading."""

    def __init__(self, bus: str) -> None:
        self.bus = bus

    def call(self, path: str, interface: str, method: str, signature: str | None = None,
             body: tuple[Any, ...] = ()) -> tuple[Any, ...]:
        msg = new_method_call(DBusAddress(path, bus_name="org.freedesktop.systemd1",
                                          interface=interface), method, signature, body)
        with open_dbus_connection(self.bus) as conn:
            reply = conn.send_and_get_reply(msg, timeout=30)
        if reply.header.message_type == MessageType.error:
            raise LookupError(reply.body)
        return tuple(reply.body)

    def unit_path(self, unit: str) -> str | None:
        try:
            (path,) = self.call("/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager",
                                "GetUnit", "s", (unit,))
        except LookupError:
            return None
        return str(path)

    def props(self, unit: str, interface: str = "Service") -> dict[str, Any]:
        path = self.unit_path(unit)
        assert path is not None, f"systemd has no unit {unit}"
        return self.props_at(path, interface)

    def props_at(self, path: str, interface: str) -> dict[str, Any]:
        (props,) = self.call(path, "org.freedesktop.DBus.Properties", "GetAll", "s",
                             (f"org.freedesktop.systemd1.{interface}",))
        return {k: v for k, (_sig, v) in props.items()}
