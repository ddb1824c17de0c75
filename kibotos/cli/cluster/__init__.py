"""``kibo`` commands about the cluster itself: nodes and their overcommit, storage pools,
enrollment, API keys and the network (egress, resolver).
"""
