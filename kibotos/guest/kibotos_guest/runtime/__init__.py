"""The agent's own small runtime: the event loop and its tasks, the transport (virtio
serial port or vsock), the frame format and the channels over it, the byte streams of
processes, and the system calls the standard library lacks.  Nothing here knows a
request; the handlers in `..services` build on it."""
