"""Built-in process supervisor ``systemd``: units as transient services over D-Bus.

The supervisor of production hosts (see `kibotos_systemd.supervisor`).  The class is
imported inside the hook so that loading the plugin registry does not import jeepney
until a node actually builds this supervisor.  Registered through the plugin SDK
(`kibotos.sdk`) only, like any third-party plugin.
"""

from __future__ import annotations

from kibotos.sdk import Register, hookimpl

__all__ = ["kibotos_register_supervisor"]


@hookimpl
def kibotos_register_supervisor(register: Register) -> None:
    from kibotos_systemd.supervisor import SystemdSupervisor

    register(SystemdSupervisor)
