"""The data plane's client ends, what ``kibo``, the gateways and tests reach it with:
exec (on trio, or blocking for ``kibo``), files and ports.  A gateway imports only
these (tests/unit/test_architecture.py, ``GATEWAY_USES_OF_DATAPLANE``).
"""
