"""The data-plane process itself: serving, the control socket and the state the node
hands over, generations and their listening socket, TLS, metrics, the guest channels.
The node drives it through a few of these (``NODE_USES_OF_DATAPLANE``).
"""
