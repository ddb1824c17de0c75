"""The data-plane process (``kibotos dataplane serve``): exec, files and port
forwarding for the node's Instances.

It holds the client connections (exec, terminals and port forwarding over WebSocket,
file transfer over plain HTTP on the same listener), verifies session credentials with
ctrl's public key, and reaches each guest through the VMM's second agent port.  The
node starts it as its own unit and hands it the state over a local control socket.
Operator documentation: docs/dataplane.md.

Modules: `state` (what the node hands over), `control` (the control socket, both ends),
`guests` (one guest channel per Instance), `exec_session` (one exec over a WebSocket),
`ports_session` (one forwarded connection over a WebSocket), `http1` (plain HTTP beside
WebSocket on the listener), `files_api` (the file endpoints), `exec_wire` (what each
exec message means, for both exec clients), the client ends: `client` (exec on trio,
and the WebSocket every trio client opens), `exec_blocking` (exec on a socket, for kibo)
with `ws_client` (its WebSocket protocol), `files_client` and `ports_client`; `groups`
(the one error out of trio's groups), `metrics` (counters, and the node's sum over
generations), `build` (what counts as the same build for adoption), `serve` (the
process).
"""
