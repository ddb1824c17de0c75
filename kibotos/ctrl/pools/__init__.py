"""ctrl's synchronous rules for storage pools and their objects: capacity, the pools nodes
report, operator writes, Volumes, object operations, use rights and handoffs.
"""
