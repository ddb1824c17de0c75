"""The server the Exposure gateway tests run *inside* a sandbox (standard library only:
it runs under the guest's ``python3``): ``python3 exposure_server.py PORT``.

* ``GET /hello``: 200, a line naming the path and the headers the gateway passed on
  (Host, X-Forwarded-For, whether a traffic token or routing header reached it).
* ``POST /sha256``: reads the body (Content-Length or chunked) as it comes and answers
  its SHA-256 and length.
* ``GET /blob?n=N``: N bytes of the repeating pattern ``bytes(range(256))``, chunked.
* ``GET /ws`` with ``Upgrade: websocket``: the handshake, then each text frame echoed
  back as ``echo: <text>`` until a close frame.

It exits by itself after `LIFETIME` seconds, so nothing outlives a test run.
"""

import base64
import hashlib
import http.server
import struct
import sys
import threading
import time

LIFETIME = 600
PATTERN = bytes(range(256)) * 256
GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _answer(self, body, status=200):
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/hello":
            seen = (f"hello {self.path} host={self.headers.get('Host')} "
                    f"xff={self.headers.get('X-Forwarded-For')} "
                    f"token={'e2b-traffic-access-token' in self.headers} "
                    f"routing={'e2b-sandbox-id' in self.headers}\n")
            self._answer(seen.encode())
        elif self.path.startswith("/blob?n="):
            left = int(self.path.split("=", 1)[1])
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while left:
                piece = PATTERN[:min(left, len(PATTERN))]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                left -= len(piece)
            self.wfile.write(b"0\r\n\r\n")
        elif self.path == "/ws" and self.headers.get("Upgrade", "").lower() == "websocket":
            self._websocket()
        else:
            self._answer(b"no such page\n", 404)

    def do_POST(self):
        digest, size = hashlib.sha256(), 0
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while True:
                length = int(self.rfile.readline().split(b";")[0], 16)
                if length == 0:
                    self.rfile.readline()
                    break
                while length:
                    piece = self.rfile.read(min(length, 65536))
                    digest.update(piece)
                    size += len(piece)
                    length -= len(piece)
                self.rfile.readline()
        else:
            left = int(self.headers.get("Content-Length", "0"))
            while left:
                piece = self.rfile.read(min(left, 65536))
                digest.update(piece)
                size += len(piece)
                left -= len(piece)
        self._answer(f"{digest.hexdigest()} {size}\n".encode())

    def _websocket(self):
        accept = base64.b64encode(hashlib.sha1(
            (self.headers["Sec-WebSocket-Key"] + GUID).encode()).digest()).decode()
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        self.end_headers()
        self.wfile.flush()
        while True:
            head = self.rfile.read(2)
            opcode, length = head[0] & 0x0F, head[1] & 0x7F
            if length == 126:
                length = struct.unpack("!H", self.rfile.read(2))[0]
            elif length == 127:
                length = struct.unpack("!Q", self.rfile.read(8))[0]
            mask = self.rfile.read(4)
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(length)))
            if opcode == 8:
                self.wfile.write(b"\x88\x02\x03\xe8")
                self.wfile.flush()
                self.close_connection = True
                return
            reply = b"echo: " + data
            self.wfile.write(bytes([0x81, len(reply)]) + reply if len(reply) < 126 else
                             bytes([0x81, 126]) + struct.pack("!H", len(reply)) + reply)
            self.wfile.flush()


def main():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    time.sleep(LIFETIME)


if __name__ == "__main__":
    main()
