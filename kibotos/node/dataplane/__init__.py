"""The node's side of its data-plane process: start or adopt it, and keep its targets in step
with the Instance manager.  The data plane itself is `kibotos.dataplane`.
"""
