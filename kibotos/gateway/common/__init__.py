"""What both gateways (E2B and Exposure) share: the ``[ctrl]`` section of their
configuration and the credential file it names, the client of ctrl's HTTP API they
call as their own operator identity, and serving ASGI apps with hypercorn."""
