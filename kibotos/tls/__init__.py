"""TLS of the cluster: ctrl's cluster CA, the certificates it issues, and the SSL
contexts servers and clients build from them (docs/enrollment.md, "TLS").

Shared by every role, so it imports no role package.
"""
