"""Facts about the host the node runs on: usage, clock, VM statistics, incarnation, layout.

These modules read the machine and keep no Instance state; everything above builds on
them.
"""
