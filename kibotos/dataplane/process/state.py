"""What the node hands its data-plane process, checked before it replaces anything.

The node sends ``{type: "state", generation, node_id, public_key, targets{instance_id:
{agent_socket, workspace_id?}}}`` over the control socket (`kibotos.dataplane.process.control`).
The whole state is replaced at once, never patched, so a resend after a lost ack is
harmless and a process always serves one consistent view.  Bad input is refused naming
the field, and the state the process already had stays in force.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kibotos.core import ids
from kibotos.core.credentials import Verifier
from kibotos.core.errors import FailedPrecondition, InvalidArgument

#: A unix socket path must fit ``sun_path`` (108 bytes with the terminating NUL).
MAX_SOCKET_PATH = 107
_MAX_TARGETS = 100_000


@dataclass(frozen=True)
class Target:
    """One Instance the data plane may reach: its guest's data-plane agent socket, and
    for a VMM whose socket is a vsock multiplexer (Firecracker) the guest port every
    connection must ``CONNECT`` to first."""

    instance_id: str
    agent_socket: Path
    workspace_id: str | None = None
    vsock_port: int | None = None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"agent_socket": str(self.agent_socket)}
        if self.workspace_id is not None:
            body["workspace_id"] = self.workspace_id
        if self.vsock_port is not None:
            body["vsock_port"] = self.vsock_port
        return body


@dataclass(frozen=True)
class DataplaneState:
    """One complete state as handed over; `version` counts the handovers."""

    generation: int
    node_id: str
    public_key: str
    targets: Mapping[str, Target]
    verifier: Verifier = field(compare=False)
    version: int = 0

    def to_wire(self) -> dict[str, Any]:
        """The ``state`` message that produces this state (what the node sends)."""
        return state_message(self.generation, self.node_id, self.public_key,
                             self.targets.values())


def state_message(generation: int, node_id: str, public_key: str,
                  targets: Any) -> dict[str, Any]:
    """The control message handing over a whole state; `targets` is an iterable of
    `Target`."""
    return {"type": "state", "generation": generation, "node_id": node_id,
            "public_key": public_key,
            "targets": {t.instance_id: t.to_json() for t in targets}}


def _target(instance_id: object, body: object) -> Target:
    where = f"targets[{instance_id!r}]"
    try:
        iid = ids.check_object_id(instance_id, "instance ID")
    except InvalidArgument as exc:
        raise InvalidArgument(f"state: {where}: {exc.message}") from None
    if not isinstance(body, dict):
        raise InvalidArgument(f"state: {where} must be an object")
    unknown = sorted(set(body) - {"agent_socket", "workspace_id", "vsock_port"})
    if unknown:
        raise InvalidArgument(f"state: {where} has unknown keys {unknown}")
    sock = body.get("agent_socket")
    if not isinstance(sock, str) or not sock.startswith("/"):
        raise InvalidArgument(f"state: {where}.agent_socket must be an absolute path")
    if len(sock.encode()) > MAX_SOCKET_PATH:
        raise InvalidArgument(f"state: {where}.agent_socket is longer than "
                              f"{MAX_SOCKET_PATH} bytes, too long for a unix socket")
    ws = body.get("workspace_id")
    if ws is not None and not isinstance(ws, str):
        raise InvalidArgument(f"state: {where}.workspace_id must be a string")
    port = body.get("vsock_port")
    if port is not None and (type(port) is not int or not 0 < port < 2**32 - 1):
        raise InvalidArgument(f"state: {where}.vsock_port must be a port number "
                              f"(1 to {2**32 - 2}), got {port!r}")
    return Target(iid, Path(sock), ws, port)


def parse_state(message: Mapping[str, Any], *, generation: int, version: int) -> DataplaneState:
    """A `DataplaneState` from a ``state`` message meant for this `generation`.

    A message for another generation is `FailedPrecondition`: the node is talking to a
    process it did not mean (a newer one took the socket path), and must not believe
    the state arrived.
    """
    unknown = sorted(set(message) - {"type", "generation", "node_id", "public_key", "targets"})
    if unknown:
        raise InvalidArgument(f"state: unknown keys {unknown}")
    sent = message.get("generation")
    if not isinstance(sent, int) or isinstance(sent, bool) or sent < 1:
        raise InvalidArgument("state: generation must be a positive integer")
    if sent != generation:
        raise FailedPrecondition(f"state for generation {sent} sent to data-plane generation "
                                 f"{generation}")
    try:
        node_id = ids.check_node_id(message.get("node_id"))
    except InvalidArgument as exc:
        raise InvalidArgument(f"state: node_id: {exc.message}") from None
    try:
        verifier = Verifier(message.get("public_key"))
    except InvalidArgument as exc:
        raise InvalidArgument(f"state: public_key: {exc.message}") from None
    raw = message.get("targets", {})
    if not isinstance(raw, dict):
        raise InvalidArgument("state: targets must be an object keyed by instance ID")
    if len(raw) > _MAX_TARGETS:
        raise InvalidArgument(f"state: more than {_MAX_TARGETS} targets")
    targets = {t.instance_id: t for t in (_target(k, v) for k, v in raw.items())}
    return DataplaneState(sent, node_id, verifier.public_key, targets, verifier, version)
