"""The node's network commands around an Instance: admitting a create with a network,
and ``instance.set_network`` (a network switch).

A create with ``network`` is admitted only by a node with ``[network]`` whose VMM
backend gives guests a NIC (``CAN_NETWORK``), and only with a policy this node can
enforce; otherwise it is refused before anything is written (``failed_precondition``,
``details.reason`` ``no_network`` or ``network_policy``).  A switch needs the Instance
RUNNING with a network; the table is replaced in one transaction and is in force when
the command answers, without a restart (`kibotos.node.instances.network_step`).
"""

from __future__ import annotations

from typing import Any

from kibotos.core.errors import FailedPrecondition
from kibotos.core.logs import EventLogger
from kibotos.node.instances.contract import RUNNING
from kibotos.node.instances.lifecycle import Instance, Launcher
from kibotos.protocol import CreateSpec, NetworkPolicy

log = EventLogger()


def admit(launcher: Launcher, spec: CreateSpec) -> None:
    """Refuse a create whose network this node cannot give (nothing written yet)."""
    assert spec.network is not None
    step = launcher.network
    if step is None:
        raise FailedPrecondition(f"node {launcher.node_id} has no [network]: it cannot give "
                                 f"Instance {spec.instance_id} a network",
                                 details={"reason": "no_network"})
    backend = launcher.backend
    if not getattr(type(backend), "CAN_NETWORK", False):
        raise FailedPrecondition(f"the {backend.name} VMM backend of node {launcher.node_id} "
                                 "gives guests no network interface",
                                 details={"reason": "no_network"})
    _enforceable(launcher, spec.instance_id, spec.network)


def _enforceable(launcher: Launcher, instance_id: str, policy: NetworkPolicy) -> None:
    assert launcher.network is not None
    problem = launcher.network.refusal(policy)
    if problem is not None:
        raise FailedPrecondition(f"node {launcher.node_id} cannot enforce the network policy "
                                 f"of Instance {instance_id}: {problem}",
                                 details={"reason": "network_policy"})


def _running(inst: Instance) -> None:
    if inst.state != RUNNING:
        raise FailedPrecondition(f"Instance {inst.instance_id} is {inst.state}: a network "
                                 "switch needs it RUNNING", details={"reason": "not_running"})


async def switch(launcher: Launcher, inst: Instance, network: NetworkPolicy, revision: int
                 ) -> dict[str, Any]:
    """``instance.set_network``: the running Instance's slot table replaced in one
    transaction, in force when this answers (established connections are kept).
    Idempotent by revision (`NetworkStep.switch`)."""
    step = launcher.network_step(inst)
    if step is None:
        raise FailedPrecondition(f"Instance {inst.instance_id} was created without a network",
                                 details={"reason": "no_network"})
    _enforceable(launcher, inst.instance_id, network)
    _running(inst)  # a boot holds the lock for minutes: refused at once, not waited for
    async with inst.lock:
        _running(inst)
        switched = await step.switch(inst.instance_id, network, revision)
    log.info("instance network switched" if switched.changed else
             "instance network switch repeated", instance=inst.instance_id,
             revision=revision, netns=switched.record.names.netns)
    return {"network_revision": revision, "changed": switched.changed}
