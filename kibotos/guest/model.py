"""What the host knows about a guest, what it sends it, and how a guest can fail it.

These are the host-side shapes of the guest protocol (docs/guest-protocol.md).  They are
plain frozen dataclasses: the node stores `GuestInfo` in the launch record (boot ID and
capabilities of the guest it accepted), and `check-upgrade` compares
`GuestInfo.protocol_version` with the range a build accepts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from kibotos.core.errors import FailedPrecondition, Internal

#: Guest protocol versions this build speaks, inclusive.  A guest outside the range is
#: refused (the Instance is marked FAILED and its VMM left running, per the spec).
ACCEPTED_PROTOCOL_VERSIONS: tuple[int, int] = (1, 1)

#: The exact reasons of a failed stop preparation, as the spec spells them.
STOP_REASONS = (
    "deadline_exceeded",
    "retained filesystem sync failed",
    "retained filesystem freeze failed",
)


@dataclasses.dataclass(frozen=True)
class GuestInfo:
    """The guest's hello (the spec's GuestInfo): who it is and what it can do."""

    protocol_version: int
    agent_version: str = ""
    boot_id: str = ""
    capabilities: frozenset[str] = frozenset()
    instance_id: str = ""
    pid: int | None = None
    config_digest: str | None = None
    stopping: bool = False
    frozen_filesystems: tuple[str, ...] = ()

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> GuestInfo:
        """Parse a hello; only the protocol version is required of every version."""
        version = body.get("protocol_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise Internal(f"guest hello has no integer protocol_version: {dict(body)!r}")

        def text(key: str) -> str:
            value = body.get(key)
            return value if isinstance(value, str) else ""

        caps = body.get("capabilities")
        frozen = body.get("frozen_filesystems")
        pid = body.get("pid")
        digest = body.get("config_digest")
        return cls(
            protocol_version=version,
            agent_version=text("agent_version"),
            boot_id=text("boot_id"),
            capabilities=frozenset(c for c in caps if isinstance(c, str))
            if isinstance(caps, list)
            else frozenset(),
            instance_id=text("instance_id"),
            pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
            config_digest=digest if isinstance(digest, str) else None,
            stopping=body.get("stopping") is True,
            frozen_filesystems=tuple(p for p in frozen if isinstance(p, str))
            if isinstance(frozen, list)
            else (),
        )

    def to_json(self) -> dict[str, Any]:
        """The record the node keeps of the guest it accepted."""
        return {
            "protocol_version": self.protocol_version,
            "agent_version": self.agent_version,
            "boot_id": self.boot_id,
            "capabilities": sorted(self.capabilities),
        }


class GuestProtocolUnsupported(FailedPrecondition):
    """The guest speaks a protocol version outside the range this build accepts."""

    def __init__(self, info: GuestInfo, accepted: tuple[int, int]) -> None:
        low, high = accepted
        span = str(low) if low == high else f"{low}–{high}"
        super().__init__(
            f"guest protocol version {info.protocol_version} is outside the range this "
            f"kibotos accepts ({span}); guest agent {info.agent_version or 'unknown'}",
            details={"protocol_version": info.protocol_version, "accepted": [low, high]},
        )
        self.info = info


class GuestStopFailed(FailedPrecondition):
    """stop_prepare failed; `reason` is one of STOP_REASONS.

    The message starts with ``prepare guest stop:`` as the Workspace error does.  After a
    sync or freeze failure the guest keeps the file systems in `frozen` frozen.
    """

    def __init__(self, reason: str, message: str, details: dict[str, Any]) -> None:
        super().__init__(f"prepare guest stop: {message}", details=details)
        self.reason = reason
        frozen = details.get("frozen")
        self.frozen: tuple[str, ...] = tuple(frozen) if isinstance(frozen, list) else ()


@dataclasses.dataclass(frozen=True)
class ExitStatus:
    """How a guest process ended: an exit code, or the signal that killed it."""

    exit_code: int | None
    signal: int | None = None
    signal_name: str | None = None

    @property
    def returncode(self) -> int:
        """The shell's convention: the exit code, or 128 + the signal number."""
        if self.exit_code is not None:
            return self.exit_code
        return 128 + (self.signal or 0)

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> ExitStatus:
        code, sig, name = body.get("exit_code"), body.get("signal"), body.get("signal_name")
        if not isinstance(code, int) and not isinstance(sig, int):
            raise Internal(f"guest exit event has neither exit_code nor signal: {dict(body)!r}")
        return cls(
            code if isinstance(code, int) else None,
            sig if isinstance(sig, int) else None,
            name if isinstance(name, str) else None,
        )


@dataclasses.dataclass(frozen=True)
class Volume:
    """A block device the guest mounts (a Volume or another retained disk)."""

    device: str
    mount_point: str
    fs_type: str = "ext4"
    options: str = ""
    read_only: bool = False
    retained: bool = True  # synced and frozen by stop_prepare


@dataclasses.dataclass(frozen=True)
class Dns:
    nameservers: Sequence[str] = ()
    search: Sequence[str] = ()
    options: Sequence[str] = ()


@dataclasses.dataclass(frozen=True)
class GuestAddress:
    """One address of the guest's interface, with its gateway (the default route of
    its family)."""

    family: str  # "ipv4" or "ipv6"
    address: str
    prefix: int
    gateway: str


@dataclasses.dataclass(frozen=True)
class GuestNetwork:
    """The guest's network interface: found by its MAC, given these addresses and a
    default route per family (capability ``configure.network``)."""

    mac: str
    addresses: Sequence[GuestAddress] = ()


#: The capability a guest needs for `LaunchConfig.network`.
NETWORK_CAPABILITY = "configure.network"


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """What the guest is told at launch and again after a node restart.

    Fields left as None are left as the guest has them, so the node can hand over just
    the current DNS.  `retained_filesystems` names file systems mounted before the agent
    started (the writable layer) that stop_prepare syncs and freezes with the Volumes.
    """

    hostname: str | None = None
    env: Mapping[str, str] | None = None
    dns: Dns | None = None
    volumes: Sequence[Volume] | None = None
    retained_filesystems: Sequence[str] | None = None
    network: GuestNetwork | None = None

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {}
        if self.hostname is not None:
            body["hostname"] = self.hostname
        if self.env is not None:
            body["env"] = dict(self.env)
        if self.dns is not None:
            body["dns"] = {
                "nameservers": list(self.dns.nameservers),
                "search": list(self.dns.search),
                "options": list(self.dns.options),
            }
        if self.volumes is not None:
            body["volumes"] = [dataclasses.asdict(v) for v in self.volumes]
        if self.retained_filesystems is not None:
            body["retained_filesystems"] = list(self.retained_filesystems)
        if self.network is not None:
            body["network"] = {"mac": self.network.mac,
                               "addresses": [dataclasses.asdict(a)
                                             for a in self.network.addresses]}
        return body


@dataclasses.dataclass(frozen=True)
class ConfigureResult:
    changed: bool
    actions: tuple[str, ...]
    config_digest: str | None


@dataclasses.dataclass(frozen=True)
class StopPrepareResult:
    ended: tuple[int, ...]
    synced: tuple[str, ...]
    frozen: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ChannelStatistics:
    frames_received: int
    frames_sent: int
    protocol_errors: int
    open_processes: int
