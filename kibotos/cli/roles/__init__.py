"""``kibotos`` commands that run a role on a host (ctrl, node, data plane, egress,
gateways, the dev cluster) and ``kibotos plugins``.
"""
