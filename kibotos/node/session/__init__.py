"""The node's control session to ctrl: enrollment identity, the WebSocket, the report,
backoff, and how ctrl's HTTP refusals read on the node.
"""
