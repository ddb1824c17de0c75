#!/usr/bin/env python3
"""A stand-in for Firecracker: its API on a unix socket, validated against the document.

No Firecracker binary can be installed on these machines, so the backend is tested
against this process instead.  It answers like Firecracker (204 without a body, 400 with
``{"fault_message": …}``, the instance info on ``GET /``), refuses every request the
document (`fc_spec`) does not allow, enforces the ordering the document states, checks
that every file a request names exists in the jail and can be opened by the VMM account
(it runs as root, unjailed, so it checks the mode bits the kernel would), and records
each call as one JSON line.  It boots nothing: after ``InstanceStart`` its vsock socket
forwards ``CONNECT <port>`` to a unix socket given per port (the real guest agent run on
the host), answering ``OK <host port>`` like Firecracker, or closing the connection when
nothing listens there.  Usage::

    fc_standin.py --chroot DIR --uid N --gid N [--record FILE] [--guest-port P=SOCK]…
                  [--console-text TEXT] -- <Firecracker's own arguments>
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import posixpath
import socket
import socketserver
import stat
import sys
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from fc_spec import ApiDocument, Refused, checked_id

NOT_AFTER = "The requested operation is not supported after starting the microVM."
NOT_BEFORE = "The requested operation is not supported before starting the microVM."
#: Firecracker's own command-line flags (src/firecracker/src/main.rs): with a value, and without.
FC_VALUE_FLAGS = {"api-sock", "id", "seccomp-filter", "start-time-us", "start-time-cpu-us",
                  "parent-cpu-time-us", "config-file", "metadata", "log-path", "level",
                  "module", "metrics-path", "describe-snapshot", "http-api-max-payload-size",
                  "mmds-size-limit"}
FC_BOOL_FLAGS = {"no-seccomp", "no-api", "show-level", "show-log-origin", "boot-timer",
                 "version", "snapshot-version", "enable-pci"}
MACHINE_DEFAULTS = {"vcpu_count": 1, "mem_size_mib": 128, "smt": False,
                    "track_dirty_pages": False, "huge_pages": "None"}


def _may(st: os.stat_result, uid: int, gid: int, bits: int) -> bool:
    """The owner/group/other check of `bits` (4 read, 2 write, 1 execute)."""
    if st.st_uid == uid:
        return (st.st_mode >> 6) & bits == bits
    if st.st_gid == gid:
        return (st.st_mode >> 3) & bits == bits
    return st.st_mode & bits == bits


class Microvm:
    """The state of one stand-in Firecracker, and the handling of one API request."""

    def __init__(self, args: argparse.Namespace, doc: ApiDocument) -> None:
        self.doc = doc
        self.chroot = Path(args.chroot).resolve()
        self.uid, self.gid = args.uid, args.gid
        self.instance_id = args.fc_id
        self.record = Path(args.record) if args.record else None
        self.guest_ports: dict[int, str] = {}
        for item in args.guest_port:
            port, _, path = item.partition("=")
            self.guest_ports[int(port)] = path
        self.console_text: list[str] = args.console_text
        self.lock = threading.Lock()
        self.started = False
        self.machine = dict(MACHINE_DEFAULTS)
        self.boot_source: dict[str, Any] | None = None
        self.drives: dict[str, dict[str, Any]] = {}
        self.net: dict[str, dict[str, Any]] = {}
        self.vsock: dict[str, Any] | None = None
        self.vsock_listener: socket.socket | None = None
        self.balloon: dict[str, Any] | None = None
        self.host_ports = itertools.count(1073741824)

    # ------------------------------------------------------------------ the jail

    def jail_path(self, path: str, what: str) -> Path:
        """`path` as Firecracker inside the jail resolves it; symlinks are refused (they
        would resolve differently out here)."""
        rel = posixpath.normpath("/" + path).lstrip("/")
        full = self.chroot / rel
        cur = self.chroot
        for part in Path(rel).parts:
            cur = cur / part
            if cur.is_symlink():
                raise Refused(400, f"{what}: {path}: the stand-in does not follow symlinks")
        return full

    def check_open(self, path: str, what: str, *, write: bool) -> None:
        full = self.jail_path(path, what)
        dirs = [self.chroot]
        for part in full.relative_to(self.chroot).parts[:-1]:
            dirs.append(dirs[-1] / part)
        try:
            for d in dirs:  # every directory on the way needs search permission
                if not _may(d.stat(), self.uid, self.gid, 1):
                    raise Refused(400, f"{what}: {path}: Permission denied (os error 13)")
            st = full.stat()
        except FileNotFoundError:
            raise Refused(400, f"{what}: {path}: No such file or directory (os error 2)"
                          ) from None
        if not stat.S_ISREG(st.st_mode):
            raise Refused(400, f"{what}: {path}: not a regular file")
        if not _may(st, self.uid, self.gid, 6 if write else 4):
            raise Refused(400, f"{what}: {path}: Permission denied (os error 13)")

    # ------------------------------------------------------------------ requests

    def handle(self, method: str, path: str, raw: bytes) -> tuple[int, Any]:
        with self.lock:
            body: Any = None
            try:
                op, params = self.doc.find(method, path)
                body = self.doc.validate(op, raw)
                if op.pre_boot and self.started:
                    raise Refused(400, NOT_AFTER)
                if op.post_boot and not self.started:
                    raise Refused(400, NOT_BEFORE)
                handler = getattr(self, f"op_{op.operation_id}", None)
                if handler is None:
                    raise Refused(400, f"stand-in: {op.operation_id} is not modelled")
                status, answer = handler(body, **params)
            except Refused as exc:
                status, answer = exc.status, {"fault_message": exc.message}
            self._record(method, path, body, raw, status, answer)
            return status, answer

    def _record(self, method: str, path: str, body: Any, raw: bytes, status: int,
                answer: Any) -> None:
        if self.record is None:
            return
        if body is None and raw:  # refused before it was decoded: keep what came
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw.decode("utf-8", "replace")
        entry = {"method": method, "path": path, "status": status, "body": body}
        if status >= 400:
            entry["fault_message"] = answer["fault_message"]
        with open(self.record, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def op_describeInstance(self, body: None) -> tuple[int, Any]:
        return 200, {"app_name": "Firecracker", "id": self.instance_id,
                     "state": "Running" if self.started else "Not started",
                     "vmm_version": self.doc.version}

    def op_getFirecrackerVersion(self, body: None) -> tuple[int, Any]:
        return 200, {"firecracker_version": self.doc.version}

    def op_getMachineConfiguration(self, body: None) -> tuple[int, Any]:
        return 200, self.machine

    def op_getExportVmConfig(self, body: None) -> tuple[int, Any]:
        config: dict[str, Any] = {"machine-config": self.machine,
                                  "drives": list(self.drives.values()),
                                  "network-interfaces": list(self.net.values())}
        for key, value in (("boot-source", self.boot_source), ("vsock", self.vsock),
                           ("balloon", self.balloon)):
            if value is not None:
                config[key] = value
        return 200, config

    def _machine(self, config: dict[str, Any]) -> tuple[int, Any]:
        vcpus, mem = config["vcpu_count"], config["mem_size_mib"]
        if config.get("smt") and vcpus > 1 and vcpus % 2:
            raise Refused(400, "Machine config error: The vCPU number is invalid! The vCPU "
                               "number can only be 1 or an even number when SMT is enabled.")
        if config.get("huge_pages") == "2M" and mem % 2:
            raise Refused(400, "Machine config error: mem_size_mib must be a multiple of 2 "
                               "with 2M huge pages.")
        if mem < 1:
            raise Refused(400, "Machine config error: The memory size (MiB) is invalid.")
        self.machine = config
        return 204, None

    def op_putMachineConfiguration(self, body: dict[str, Any]) -> tuple[int, Any]:
        return self._machine({**MACHINE_DEFAULTS, **body})  # optional fields reset

    def op_patchMachineConfiguration(self, body: dict[str, Any]) -> tuple[int, Any]:
        return self._machine({**self.machine, **body})

    def op_putGuestBootSource(self, body: dict[str, Any]) -> tuple[int, Any]:
        self.check_open(body["kernel_image_path"], "Boot source error: kernel image",
                        write=False)
        if "initrd_path" in body:
            self.check_open(body["initrd_path"], "Boot source error: initrd", write=False)
        self.boot_source = body
        return 204, None

    def op_putGuestDriveByID(self, body: dict[str, Any], drive_id: str) -> tuple[int, Any]:
        checked_id(drive_id)
        if drive_id != body["drive_id"]:
            raise Refused(400, "The id from the path does not match the id from the body!")
        if ("path_on_host" in body) == ("socket" in body):
            raise Refused(400, "Drive config error: give exactly one of path_on_host "
                               "(virtio-block) and socket (vhost-user-block).")
        if "path_on_host" in body:
            if "is_read_only" not in body:
                raise Refused(400, "Drive config error: is_read_only is required for a "
                                   "virtio-block drive.")
            self.check_open(body["path_on_host"], "Drive config error: Unable to open the "
                            "block device backing file", write=not body["is_read_only"])
        if body["is_root_device"] and any(
                d["is_root_device"] for i, d in self.drives.items() if i != drive_id):
            raise Refused(400, "Drive config error: A root block device already exists!")
        self.drives[drive_id] = body
        if body["is_root_device"]:  # the root device goes first
            self.drives = {drive_id: body, **{k: v for k, v in self.drives.items()
                                              if k != drive_id}}
        return 204, None

    def op_putGuestNetworkInterfaceByID(self, body: dict[str, Any], iface_id: str
                                        ) -> tuple[int, Any]:
        checked_id(iface_id)
        if iface_id != body["iface_id"]:
            raise Refused(400, "The id from the path does not match the id from the body!")
        name = body["host_dev_name"]
        if not name or len(name.encode()) > 15:
            raise Refused(400, f"Network config error: Could not open TAP device: {name}")
        if any(n["host_dev_name"] == name for i, n in self.net.items() if i != iface_id):
            raise Refused(400, f"Network config error: The host device name {name} is "
                               "already in use.")
        mac = body.get("guest_mac")
        if mac is not None:
            parts = mac.split(":")
            if len(parts) != 6 or not all(len(p) == 2 and all(
                    c in "0123456789abcdefABCDEF" for c in p) for p in parts):
                raise Refused(400, "An error occurred when deserializing the json body of "
                                   f"a request: invalid MAC address {mac}.")
        self.net[iface_id] = body
        return 204, None

    def op_putGuestVsock(self, body: dict[str, Any]) -> tuple[int, Any]:
        path = self.jail_path(body["uds_path"], "Vsock config error")
        parent = path.parent
        if not parent.is_dir() or not _may(parent.stat(), self.uid, self.gid, 3):
            raise Refused(400, "Vsock config error: Cannot create backend for vsock device: "
                               "Error binding to the host-side Unix socket: Permission "
                               "denied (os error 13)")
        if self.vsock_listener is not None:  # a new PUT replaces the device and its socket
            self.vsock_listener.close()
            assert self.vsock is not None
            self.jail_path(self.vsock["uds_path"], "vsock").unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(path))
        except OSError as exc:
            listener.close()
            raise Refused(400, "Vsock config error: Cannot create backend for vsock device: "
                               f"Error binding to the host-side Unix socket: {exc}") from None
        os.chown(path, self.uid, self.gid)
        listener.listen(16)
        self.vsock_listener, self.vsock = listener, body
        return 204, None

    def op_putBalloon(self, body: dict[str, Any]) -> tuple[int, Any]:
        if body["amount_mib"] > self.machine["mem_size_mib"]:
            raise Refused(400, "Balloon config error: Amount of pages requested is too large.")
        self.balloon = body
        return 204, None

    def op_createSyncAction(self, body: dict[str, Any]) -> tuple[int, Any]:
        action = body["action_type"]
        if action == "InstanceStart":
            if self.started:
                raise Refused(400, NOT_AFTER)
            if self.boot_source is None:
                raise Refused(400, "Start microvm error: Cannot start microvm without kernel "
                                   "configuration.")
            self.started = True
            self._boot()
            return 204, None
        if action == "SendCtrlAltDel":
            if not self.started:
                raise Refused(400, NOT_BEFORE)
            return 204, None
        raise Refused(400, "Metrics error: the metrics system is not initialized.")

    # ------------------------------------------------------------------ "boot"

    def _boot(self) -> None:
        assert self.boot_source is not None
        print(f"stand-in: InstanceStart, kernel {self.boot_source['kernel_image_path']}, "
              f"command line: {self.boot_source.get('boot_args', '')}", flush=True)
        for line in self.console_text:
            print(line, flush=True)
        if self.vsock_listener is not None:
            threading.Thread(target=self._accept, args=(self.vsock_listener,),
                             daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(conn,), daemon=True).start()

    def _connect(self, conn: socket.socket) -> None:
        """``CONNECT <port>\\n`` -> ``OK <host port>\\n`` and a forwarded stream, or a
        closed connection when the command is bad or nothing listens on the port."""
        line = b""
        conn.settimeout(10)
        try:
            while not line.endswith(b"\n") and len(line) < 64:
                byte = conn.recv(1)
                if not byte:
                    break
                line += byte
            words = line.decode("ascii", "replace").split()
            port = int(words[1]) if len(words) == 2 and words[0] == "CONNECT" \
                and words[1].isdigit() else None
            target = self.guest_ports.get(port) if port is not None else None
            if target is None:
                conn.close()
                return
            guest = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            guest.connect(target)
        except OSError:
            conn.close()
            return
        conn.settimeout(None)
        conn.sendall(f"OK {next(self.host_ports)}\n".encode())
        for a, b in ((conn, guest), (guest, conn)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    vm: Microvm


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        status, answer = self.server.vm.handle(self.command, self.path.split("?")[0], raw)
        self.send_response(status)
        payload = json.dumps(answer).encode() if answer is not None else b""
        if status != 204:
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_PUT = do_PATCH = do_DELETE = do_POST = _serve

    def log_message(self, format: str, *args: Any) -> None:
        sys.stderr.write("stand-in api: " + (format % args) + "\n")


def parse_firecracker_args(argv: list[str]) -> dict[str, Any]:
    """Firecracker's own flags (``--name value``: its parser knows no ``=``); exits
    like Firecracker on an unknown or repeated one."""
    out: dict[str, Any] = {}
    it = iter(argv)
    for arg in it:
        name = arg.removeprefix("--")
        if not arg.startswith("--") or name not in FC_VALUE_FLAGS | FC_BOOL_FLAGS:
            sys.exit(f"Arguments parsing error: Found argument '{arg}' which wasn't expected")
        if name in out:
            sys.exit(f"Arguments parsing error: The argument '--{name}' was provided more "
                     "than once.")
        if name in FC_BOOL_FLAGS:
            out[name] = True
            continue
        value = next(it, "")
        if not value or value.startswith("--"):
            sys.exit(f"Arguments parsing error: The argument '--{name}' requires a value")
        out[name] = value
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, fc = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    p = argparse.ArgumentParser(prog="fc_standin")
    p.add_argument("--chroot", required=True)
    p.add_argument("--uid", type=int, required=True)
    p.add_argument("--gid", type=int, required=True)
    p.add_argument("--record")
    p.add_argument("--guest-port", action="append", default=[])
    p.add_argument("--console-text", action="append", default=[])
    args = p.parse_args(ours)
    fc_args = parse_firecracker_args(fc)
    args.fc_id = fc_args.get("id", "anonymous-instance")
    vm = Microvm(args, ApiDocument())
    sock = vm.jail_path(fc_args.get("api-sock", "/run/firecracker.socket"), "API socket")
    if sock.exists():
        sys.exit(f"Failed to open the API socket at: {sock}: Address in use")
    server = _Server(str(sock), _Handler)
    server.vm = vm
    os.chown(sock, vm.uid, vm.gid)
    print(f"Running Firecracker v{vm.doc.version} (stand-in)", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
