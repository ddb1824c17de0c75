"""Development tools: a whole cluster on loopback (`DevCluster`), for trying kibotos and
for the end-to-end tests."""

from kibotos.dev.cluster import ClusterError, DevCluster, ProcessStatus

__all__ = ["ClusterError", "DevCluster", "ProcessStatus"]
