"""The egress process (``kibotos egress serve``): guest TCP through a caller's SOCKS5
Egress, and guest DNS to a caller's Resolver (spec: node-and-vmm-processes, "Egress
processes"; docs/network.md, "Egress").

It runs as the unprivileged system user ``kibotos-egress`` in the host's network
namespace, started and replaced by generation by the node
(`kibotos.node.egress.supervisor`).  It opens no privileged socket itself: the node
creates each Instance's listening sockets inside the Instance's namespace and hands
them over its control socket (SCM_RIGHTS), together with the routing state and the
Egress credentials, which stay in this process's memory only.

Modules:

* `build`      what "the same build" means when the node finds one running
* `endpoints`  ``host:port`` of a SOCKS5 server or DNS upstream
* `wire`       the control socket: JSON lines with descriptors beside them
* `state`      the routing state the node hands over, checked strictly
* `sockets`    socket roles, the original destination of a redirected connection
* `socks5`     the SOCKS5 client (RFC 1928 CONNECT, RFC 1929 username/password)
* `dns_wire`   the little of the DNS message format the process reads and writes
* `upstream`   host names resolved with the node's resolver list, in order
* `dns_forward` a guest's query to its Resolver, direct or through the Egress
* `tunnel`     one guest connection through the Egress, failing closed
* `serve`      the process: control requests, the sockets' tasks, drain and exit
"""
