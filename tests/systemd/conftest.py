"""Fixtures of the systemd tests: a real user systemd (`usersystemd.UserSystemd`), the
``systemd`` supervisor on its bus, and a raw D-Bus reader to check what systemd holds.

Without what the user manager needs (root, systemd, dbus-user-session) the tests that
use it are skipped on a developer's machine but fail under CI (``CI=true``), where
`.ci/run` installs packaging/apt-test-deps.txt: a green CI must not hide them.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from jeepney import DBusAddress, MessageType, new_method_call
from jeepney.io.blocking import open_dbus_connection
from usersystemd import UserSystemd, why_unusable

from kibotos.backends import Supervisor
from kibotos.plugins import load_plugins

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture
def user_systemd() -> Iterator[UserSystemd]:
    why = why_unusable()
    if why is not None:
        if IN_CI:
            pytest.fail(f"user systemd unusable: {why}; .ci/run must install it")
        pytest.skip(why)
    manager = UserSystemd()
    try:
        yield manager
    finally:
        manager.close()


def new_supervisor(manager: UserSystemd) -> Supervisor:
    """What a (re)started node builds from ``[supervisor] backend = "systemd"``."""
    cls = load_plugins().supervisor.get("systemd")
    return cls({"bus": manager.bus})


@pytest.fixture
async def sup(user_systemd: UserSystemd) -> AsyncIterator[Supervisor]:
    supervisor = new_supervisor(user_systemd)
    yield supervisor
    for info in await supervisor.list(""):
        await supervisor.stop(info.name, timeout=1)


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


@pytest.fixture
def raw(user_systemd: UserSystemd) -> Raw:
    return Raw(user_systemd.bus)
