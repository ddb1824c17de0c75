"""ctrl's trio services that hold live state: the node sessions, the shared runtime the
services are built on (`runtime`, bundled in `services`), the Workspace, Volume and
Transfer services, the placement loop, background tasks, reconciliation, the registry
sweep, the command journal and the cluster gauges.
"""
