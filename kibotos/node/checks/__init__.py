"""Checks an operator runs on a node host, and the node's checks of its own process:
check-maintenance, check-upgrade, startup checks.
"""
