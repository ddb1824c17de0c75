"""The network record of each Instance: ``<storage.root>/network/<instance_id>.json``.

It is written before any network object exists (so a slot is never handed out twice and
a crash leaves a record that names what to remove) and removed after the last object is
gone.  It holds what adoption needs without asking anyone:

* ``slot``: the slot's addresses (`slots.SlotAddresses`), never recomputed;
* ``names``: the namespace, veth and tap names (derived, kept for the operator);
* ``policy``: the network policy in force, ``revision`` its revision (ctrl's, from
  ``instance.create`` or ``instance.set_network``; None when none was given);
  ``pending_policy`` and ``pending_revision``: one being switched to (set before its
  table is written, cleared after; a record with it is the "network switch half done"
  of check-maintenance);
* ``facts``: the node-side inputs the table was last written from (management CIDRs,
  uplink addresses, resolvers, pools), so a reader can tell a table that was changed by
  hand from one written under another configuration.

Allocation is serialized by the one `NetworkRecords` object of a node (the owner lock of
the storage root keeps a second node process away).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kibotos.core import atomicfile
from kibotos.core.errors import FailedPrecondition, InvalidArgument
from kibotos.network_config import NetworkSection
from kibotos.node.network.names import NetworkNames
from kibotos.node.network.policy import NetworkPolicy, to_record
from kibotos.node.network.slots import SlotAddresses, lowest_free, slot_addresses

FORMAT = 1


@dataclass(frozen=True)
class NetworkFacts:
    """The node-side inputs of a slot table."""

    management_cidrs: tuple[str, ...]
    uplink_addresses: tuple[str, ...]
    resolvers: tuple[str, ...]
    pools: tuple[str, ...]

    @classmethod
    def current(cls, config: NetworkSection, uplink_addresses: list[str]) -> NetworkFacts:
        pools = [config.ipv4_pool, *([config.ipv6_pool] if config.ipv6_pool else [])]
        return cls(management_cidrs=tuple(config.management_cidrs),
                   uplink_addresses=tuple(uplink_addresses),
                   resolvers=tuple(config.resolvers), pools=tuple(pools))

    def to_record(self) -> dict[str, list[str]]:
        return {k: list(v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_record(cls, value: Any) -> NetworkFacts:
        keys = {f.name for f in dataclasses.fields(cls)}
        if (not isinstance(value, dict) or set(value) != keys
                or not all(isinstance(v, list) and all(isinstance(x, str) for x in v)
                           for v in value.values())):
            raise InvalidArgument(f"malformed network facts {value!r}")
        return cls(**{k: tuple(v) for k, v in value.items()})


@dataclass(frozen=True)
class NetworkRecord:
    instance_id: str
    scope: str
    slot: SlotAddresses
    policy: dict[str, Any]
    facts: NetworkFacts
    pending_policy: dict[str, Any] | None = None
    revision: int | None = None
    pending_revision: int | None = None
    created_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())

    @property
    def names(self) -> NetworkNames:
        return NetworkNames.of(self.scope, self.instance_id)

    def to_record(self) -> dict[str, Any]:
        names = self.names
        return {"format": FORMAT, "instance_id": self.instance_id, "scope": self.scope,
                "slot": self.slot.to_record(), "policy": self.policy,
                "pending_policy": self.pending_policy, "facts": self.facts.to_record(),
                "revision": self.revision, "pending_revision": self.pending_revision,
                "names": {"netns": names.netns, "host_veth": names.host_veth,
                          "ns_veth": names.ns_veth, "tap": names.tap},
                "created_at": self.created_at}

    @classmethod
    def from_record(cls, value: Any, source: str) -> NetworkRecord:
        if not isinstance(value, dict):
            raise FailedPrecondition(f"network record {source} is not a JSON object")
        if value.get("format") != FORMAT:
            raise FailedPrecondition(f"network record {source} has format "
                                     f"{value.get('format')!r}; this node reads {FORMAT}")
        try:
            policy, pending = value["policy"], value.get("pending_policy")
            if not isinstance(policy, dict) or not (pending is None or isinstance(pending, dict)):
                raise InvalidArgument("policy and pending_policy must be objects")
            revision, pending_revision = value.get("revision"), value.get("pending_revision")
            for what, number in (("revision", revision), ("pending_revision", pending_revision)):
                if number is not None and (isinstance(number, bool) or not isinstance(number, int)):
                    raise InvalidArgument(f"{what} must be an integer or null")
            return cls(instance_id=str(value["instance_id"]), scope=str(value["scope"]),
                       slot=SlotAddresses.from_record(value["slot"]), policy=policy,
                       pending_policy=pending, facts=NetworkFacts.from_record(value["facts"]),
                       revision=revision, pending_revision=pending_revision,
                       created_at=str(value.get("created_at", "")))
        except (KeyError, ValueError, InvalidArgument) as exc:
            raise FailedPrecondition(f"malformed network record {source}: {exc}") from None


class NetworkRecords:
    """The records directory of one node (``<storage.root>/network``)."""

    def __init__(self, directory: Path, *, prefix: str = "") -> None:
        self.directory = directory
        self.prefix = prefix  # of temporary files (atomicfile)
        self._lock = threading.Lock()

    def path(self, instance_id: str) -> Path:
        return self.directory / f"{instance_id}.json"

    def read(self, instance_id: str) -> NetworkRecord | None:
        path = self.path(instance_id)
        try:
            value = atomicfile.read_json(path)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise FailedPrecondition(f"unreadable network record {path}: {exc}") from None
        return NetworkRecord.from_record(value, str(path))

    def all(self) -> list[NetworkRecord]:
        try:
            entries = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return []
        found = []
        for name in entries:
            if name.startswith(".") or not name.endswith(".json"):
                continue  # temporary files of interrupted writes
            record = self.read(name.removesuffix(".json"))
            if record is not None:
                found.append(record)
        return found

    def write(self, record: NetworkRecord) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomicfile.write_json(self.path(record.instance_id), record.to_record(),
                              prefix=self.prefix, mode=0o600)

    def allocate(self, instance_id: str, scope: str, config: NetworkSection,
                 policy: NetworkPolicy, uplink_addresses: list[str],
                 revision: int | None = None) -> NetworkRecord:
        """The Instance's record: the one already on disk (a retry), or a new one with
        the lowest free slot, written durably before this returns."""
        NetworkNames.of(scope, instance_id)  # refuse a bad ID or scope before anything
        with self._lock:
            existing = self.read(instance_id)
            if existing is not None:
                return existing
            taken = [r.slot.index for r in self.all()]
            slot = slot_addresses(config, lowest_free(taken, config.slot_count))
            record = NetworkRecord(instance_id=instance_id, scope=scope, slot=slot,
                                   policy=to_record(policy), revision=revision,
                                   facts=NetworkFacts.current(config, uplink_addresses))
            self.write(record)
            return record

    def remove(self, instance_id: str) -> None:
        try:
            self.path(instance_id).unlink()
        except FileNotFoundError:
            return
        atomicfile.fsync_dir(self.directory)
