"""Built-in process supervisor ``direct``: units as detached process groups.

For hosts without systemd, for development and for tests (see
`kibotos_direct.supervisor`).  The class is imported inside the hook so that the
launcher, which imports this package in a fresh interpreter at every unit start, does
not pay for trio.  Registered through the plugin SDK (`kibotos.sdk`) only, like any
third-party plugin.
"""

from __future__ import annotations

from kibotos.sdk import Register, hookimpl

__all__ = ["kibotos_register_supervisor"]


@hookimpl
def kibotos_register_supervisor(register: Register) -> None:
    from kibotos_direct.supervisor import DirectSupervisor

    register(DirectSupervisor)
