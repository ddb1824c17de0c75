"""What the node keeps on disk about its Instances: launch and Instance records,
attachment records, the registry of ended Instances, machine logs.

Every record that must survive a crash is written through `kibotos.core.atomicfile`.
"""
