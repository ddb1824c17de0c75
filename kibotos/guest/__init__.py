"""The guest agent (`agent.py`, copied into Template images) and its host-side client.

The wire protocol is documented in docs/guest-protocol.md.  `AGENT_PATH` is the file a
Template build copies into the image (standard library only, Python >= 3.11).
"""

from pathlib import Path

from kibotos.guest.agent import AGENT_VERSION, DEFAULT_PORT_NAME, PROTOCOL_VERSION
from kibotos.guest.client import (
    GuestChannel,
    connect_unix_with_retry,
    open_guest_channel,
)
from kibotos.guest.model import (
    ACCEPTED_PROTOCOL_VERSIONS,
    STOP_REASONS,
    ChannelStatistics,
    ConfigureResult,
    Dns,
    ExitStatus,
    GuestInfo,
    GuestProtocolUnsupported,
    GuestStopFailed,
    LaunchConfig,
    StopPrepareResult,
    Volume,
)
from kibotos.guest.streams import GuestInputStream, GuestOutputStream, GuestProcess

#: The agent script to install in guest images.
AGENT_PATH = Path(__file__).with_name("agent.py")

__all__ = [
    "ACCEPTED_PROTOCOL_VERSIONS",
    "AGENT_PATH",
    "AGENT_VERSION",
    "DEFAULT_PORT_NAME",
    "PROTOCOL_VERSION",
    "STOP_REASONS",
    "ChannelStatistics",
    "ConfigureResult",
    "Dns",
    "ExitStatus",
    "GuestChannel",
    "GuestInfo",
    "GuestInputStream",
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
