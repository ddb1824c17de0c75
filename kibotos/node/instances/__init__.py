"""Instances on the node: the command arguments, the manager, one Instance's lifecycle,
stuck releases, and adoption at node start.
"""
