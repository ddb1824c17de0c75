"""The node role: one host, its control session to ctrl, storage pools and Instances.

Rooms by lifecycle (docs/architecture.md, "Layout and layer order"): `host` (facts about
the machine), `records` (what the node keeps on disk about its Instances), `storage`
(pools and their objects), `runtime` (the VM runtime a launch pins), `instances` (the
Instance manager, lifecycle and adoption), `session` (the control session to ctrl),
`dataplane` (the node's side of its data-plane process), `checks` (check-maintenance,
check-upgrade, startup checks); `serve` wires them.
"""
