"""ctrl's synchronous rules and store transactions for nodes, enrollment, overcommit,
Instances, Workspaces and placement admission.  No trio here: every function runs inside
one store transaction, so it can be called from a thread and tested without an event loop.
"""
