"""The VM runtime a launch pins: runtime installations, the build identity of this node,
and how Volumes appear to the guest.
"""
