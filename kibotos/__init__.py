"""kibotos: Workspaces in microVMs across a cluster of nodes, under one control plane."""

from kibotos._version import __version__

__all__ = ["__version__"]
