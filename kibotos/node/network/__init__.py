"""Workspace networking on the node: each Instance's network namespace, its slot table,
and the node's table in the host namespace (docs/network.md).

Import from the modules (this file re-exports nothing, so ``kibotos.config`` can load
`config` without pulling in pyroute2):

* `config`       ``[network]`` of the node config
* `cidrs`        CIDR parsing, the ranges no guest ever reaches
* `policy`       a Workspace's network policy, and whether this node can enforce it
* `names`        every object's name, from the node's scope and the Instance ID
* `slots`        which pool addresses an Instance gets
* `records`      ``<storage.root>/network/<instance_id>.json``, the slot allocator
* `netns`        named namespaces; doing things in one from a short-lived thread
* `tap`          the guest's persistent tap, and a descriptor on it for the VMM
* `plumbing`     setup and teardown of an Instance's namespace, veth, tap, addresses
* `nft`          ``nft`` in a namespace: one transaction in, JSON out
* `slot_table`   the per-Instance table, generated from a policy
* `table_check`  reading a table back: differences and the four refusal cases
* `enforce`      first table, network switch, adoption rewrite, isolation
* `host_table`   the node's table in the host namespace (egress, the host unreachable)
"""
