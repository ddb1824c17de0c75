"""ctrl's trio services that hold live state: the node sessions, the Workspace and Volume
services, placement loop, background tasks, reconciliation, the registry sweep, the
command journal and the cluster gauges.
"""
