"""The guest side of a VM that lives on the host: Platforms and Template images.

A *Platform* is a guest kernel (an ELF ``vmlinux`` that ``-M microvm`` boots through
PVH) plus the initramfs whose ``/init`` loads the virtio modules, stacks the writable
layer over the read-only Template image and starts the guest agent.  A *Template* is
an ext4 root file system image that runs on a Platform.  Both are built once, cached by
the digest of their inputs, and only read afterwards.  See docs/vm.md.
"""
