"""What the node does with the data-plane process it finds running: the spec's table.

(spec: node-and-vmm-processes, "Data-plane processes")

| running process                                  | action        | its connections |
|--------------------------------------------------|---------------|-----------------|
| same build, same listen address                  | `ADOPT`       | not affected    |
| another build on the same release line           | `HAND_OVER`   | not affected    |
| same release line, another listen address        | `REBIND`      | not affected    |
| another release line, or it cannot hand over     | `RESTART`     | dropped         |

`HAND_OVER`: a new generation takes over the listening socket
(`kibotos.dataplane.process.listen_handover`), then the old one drains.  `REBIND`: the new one
binds the new address, then the old one drains on the old.  `RESTART`: the old one is
ended first (its 10 s drain), then the new one binds.  A process that does not say it
can hand over (``handover`` in its status: builds before the handover existed) is
restarted.  Changed listener settings (`decide`'s ``settings``: what the process
reports in its status under the same keys, such as whether it serves TLS) belong to
the `HAND_OVER` row too: the handed-over socket is plain TCP and TLS wraps each
accepted connection, so a new generation with new settings serves on the same socket.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kibotos.node.runtime.build_identity import same_release_line

ADOPT = "adopt"
HAND_OVER = "hand over"
REBIND = "rebind"
RESTART = "restart"


@dataclass(frozen=True)
class Decision:
    action: str
    reason: str


def decide(status: dict[str, Any], *, build: str, listen: str,
           settings: Mapping[str, object] | None = None) -> Decision:
    """The row of the table for a running generation's `status` (as its control socket
    answers it), when this node would start `build` on `listen` with the listener
    `settings` (each compared with the status's value under its key)."""
    running_build = str(status.get("build"))
    running_listen = status.get("configured_listen")
    wanted = dict(settings or {})
    changed = sorted(key for key, value in wanted.items() if status.get(key) != value)
    if running_build == build and running_listen == listen and not changed:
        return Decision(ADOPT, "the same build, listen address and settings")
    if not same_release_line(running_build, build):
        return Decision(RESTART, f"another release line ({running_build}; this node would "
                                 f"start {build})")
    if status.get("handover") is not True:
        return Decision(RESTART, f"it cannot hand over its listening socket ({running_build})")
    if running_listen != listen:
        return Decision(REBIND, f"the listen address changed ({running_listen} -> {listen})")
    if running_build == build:
        return Decision(HAND_OVER, "the listener settings changed ("
                        + ", ".join(f"{key} {status.get(key)!r} -> {wanted[key]!r}"
                                    for key in changed) + ")")
    return Decision(HAND_OVER, f"another build on the same release line ({running_build}; "
                               f"this node starts {build})")
