"""The data-plane process (``kibotos dataplane serve``): exec, files and port
forwarding for the node's Instances.

It holds the client connections (exec, terminals and port forwarding over WebSocket,
file transfer over plain HTTP on the same listener), verifies session credentials with
ctrl's public key, and reaches each guest through the VMM's second agent port.  The
node starts it as its own unit and hands it the state over a local control socket.
Operator documentation: docs/dataplane.md.

Subpackages: `process` (the process itself: `serve`, `control` (the control socket,
both ends), `state` (what the node hands over), `guests` (one guest channel per
Instance), `metrics` (counters, and the node's sum over generations), `build` (what
counts as the same build for adoption), `listen_handover` and `counted_listener` (a
generation's listening socket), `tls_listener`, `groups` (the one error out of trio's
groups)); `endpoints` (what one connection is served: `exec_session` and
`ports_session` over a WebSocket, `http1` (plain HTTP beside WebSocket on the
listener), `files_api` (the file endpoints), `relay`); `clients` (the client ends:
`client` (exec on trio, and the WebSocket every trio client opens), `exec_blocking`
(exec on a socket, for kibo) with `ws_client` (its WebSocket protocol), `exec_wire` (what
each exec message means, for both exec clients), `files_client`, `ports_client`,
`tls_client`, `until_none`).
"""
