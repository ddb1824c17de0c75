"""What the listener serves on one client connection: exec and ports over WebSocket,
the file endpoints over plain HTTP/1.1, and the relay they share with the guest.
"""
