"""A TCP/HTTP client the network tests run in a real guest (``python3 -c FETCH
TARGET…``, Debian's python3 in ``kibotos-base``): what each target answers, or why it
could not be reached, as one JSON object."""

#: In the guest: `fetch` of ``host:port`` over HTTP (``failed: …`` when it cannot be),
#: of a name alone its IPv4 address; names resolved by the guest's own resolver (its
#: /etc/resolv.conf).
FETCH_DEF = r"""
import errno, json, os, socket, sys, time
def fetch(target):
    if ":" not in target:
        try:
            return socket.gethostbyname(target)
        except socket.gaierror as exc:
            return "failed: resolve " + str(exc)
    host, port = target.rsplit(":", 1)
    try:
        family, _, _, _, address = socket.getaddrinfo(host.strip("[]"), int(port),
                                                      type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        return "failed: resolve " + str(exc)
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(3)
    try:
        s.connect(address)
        s.sendall(b"GET / HTTP/1.0\r\nHost: " + host.encode() + b"\r\n\r\n")
        data = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    except socket.timeout:
        return "failed: timeout"
    except OSError as exc:
        return "failed: " + errno.errorcode.get(exc.errno or 0, str(exc))
    finally:
        s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return body.decode() if head.startswith(b"HTTP/") else "failed: no answer"
"""
#: Each argument fetched; one JSON object of the answers.
FETCH = FETCH_DEF + "print(json.dumps({t: fetch(t) for t in sys.argv[1:]}))\n"
