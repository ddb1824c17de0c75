"""The guest agent (the `kibotos_guest` package and its launcher `agent.py`, both
copied into Template images) and its host-side client.

The wire protocol is documented in docs/guest-protocol.md.  `AGENT_PATH` is the launcher
(``python3 AGENT_PATH --socket …`` runs the agent anywhere); `AGENT_PACKAGE_DIR` is the
package beside it (standard library only, Python >= 3.11).  A Template build installs
both under /usr/lib/kibotos-guest/ (`kibotos.platform.build_template.agent_files`).

The client and the streams (which need trio) are imported on first use of their
names, so that a user of the model alone (``kibo workspace exec`` reads an
`ExitStatus`) does not pay trio's import.
"""

from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kibotos.guest.kibotos_guest import AGENT_VERSION, DEFAULT_PORT_NAME, PROTOCOL_VERSION
from kibotos.guest.model import (
    ACCEPTED_PROTOCOL_VERSIONS,
    NETWORK_CAPABILITY,
    STOP_REASONS,
    ChannelStatistics,
    ConfigureResult,
    Dns,
    ExitStatus,
    GuestAddress,
    GuestInfo,
    GuestNetwork,
    GuestProtocolUnsupported,
    GuestStopFailed,
    LaunchConfig,
    StopPrepareResult,
    Volume,
)

if TYPE_CHECKING:
    from kibotos.guest.client import (
        GuestChannel,
        connect_unix_with_retry,
        open_guest_channel,
    )
    from kibotos.guest.streams import GuestInputStream, GuestOutputStream, GuestProcess

#: The names imported on first use, and their modules.
_LAZY = {
    "GuestChannel": "kibotos.guest.client",
    "connect_unix_with_retry": "kibotos.guest.client",
    "open_guest_channel": "kibotos.guest.client",
    "GuestInputStream": "kibotos.guest.streams",
    "GuestOutputStream": "kibotos.guest.streams",
    "GuestProcess": "kibotos.guest.streams",
}

#: The agent's launcher script.
AGENT_PATH = Path(__file__).with_name("agent.py")
#: The agent's package, which the launcher imports from its own directory.
AGENT_PACKAGE_DIR = Path(__file__).with_name("kibotos_guest")

__all__ = [
    "ACCEPTED_PROTOCOL_VERSIONS",
    "AGENT_PACKAGE_DIR",
    "AGENT_PATH",
    "AGENT_VERSION",
    "DEFAULT_PORT_NAME",
    "NETWORK_CAPABILITY",
    "PROTOCOL_VERSION",
    "STOP_REASONS",
    "ChannelStatistics",
    "ConfigureResult",
    "Dns",
    "ExitStatus",
    "GuestAddress",
    "GuestChannel",
    "GuestInfo",
    "GuestInputStream",
    "GuestNetwork",
    "GuestOutputStream",
    "GuestProcess",
    "GuestProtocolUnsupported",
    "GuestStopFailed",
    "LaunchConfig",
    "StopPrepareResult",
    "Volume",
    "connect_unix_with_retry",
    "open_guest_channel",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value
