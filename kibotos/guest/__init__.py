"""The guest agent (the `kibotos_guest` package and its launcher `agent.py`, both
copied into Template images) and its host-side client.

The wire protocol is documented in docs/guest-protocol.md.  `AGENT_PATH` is the launcher
(``python3 AGENT_PATH --socket …`` runs the agent anywhere); `AGENT_PACKAGE_DIR` is the
package beside it (standard library only, Python >= 3.11).  A Template build installs
both under /usr/lib/kibotos-guest/ (`kibotos.platform.build_template.agent_files`).
"""

from pathlib import Path

from kibotos.guest.client import (
    GuestChannel,
    connect_unix_with_retry,
    open_guest_channel,
)
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
from kibotos.guest.streams import GuestInputStream, GuestOutputStream, GuestProcess

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
