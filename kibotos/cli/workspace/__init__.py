"""``kibo`` commands about what runs in the cluster: Workspaces, Volumes, Templates,
Transfers, and reaching into a Workspace (exec, cp, port-forward).
"""
