"""The stand-in Firecracker and the fake jailer are themselves tested: a stand-in that
accepted anything would prove nothing about the backend.

The stand-in runs as its own process on a unix socket, as the backend meets it; these
tests talk to it with a plain HTTP client."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fake_jailer
import httpx
import pytest
from fc_harness import STANDIN, TIMEOUT, VMM_GID, VMM_UID, short_dir
from fc_spec import ApiDocument

DOC = ApiDocument()


class Standin:
    def __init__(self, chroot: Path, *extra: str) -> None:
        self.chroot = chroot
        self.record = chroot.parent / "calls.jsonl"
        self.sock = chroot / "run" / "firecracker.socket"
        self.log = open(chroot.parent / "standin.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, str(STANDIN), "--chroot", str(chroot), "--uid", str(VMM_UID),
             "--gid", str(VMM_GID), "--record", str(self.record), *extra, "--",
             "--id", "vm-1", "--api-sock", "/run/firecracker.socket"],
            stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + TIMEOUT
        while not self.sock.exists():
            assert self.proc.poll() is None, self.log_text()
            assert time.monotonic() < deadline, "the stand-in did not create its socket"
            time.sleep(0.02)
        self.client = httpx.Client(transport=httpx.HTTPTransport(uds=str(self.sock)),
                                   base_url="http://localhost", timeout=TIMEOUT)

    def log_text(self) -> str:
        return (self.chroot.parent / "standin.log").read_text(errors="replace")

    def call(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None
             ) -> httpx.Response:
        content = raw if raw is not None else (
            None if body is None else json.dumps(body).encode())
        return self.client.request(method, path, content=content)

    def calls(self) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.record.read_text().splitlines()]

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(TIMEOUT)
        self.log.close()


@pytest.fixture
def jail() -> Iterator[Path]:
    """A jail root as the jailer leaves it, with a kernel, a disk and a root-only file."""
    with short_dir() as root:
        chroot = root / "root"
        for d in ("", "run", "dev"):
            (chroot / d).mkdir(exist_ok=True)
            os.chmod(chroot / d, 0o700)
            os.chown(chroot / d, VMM_UID, VMM_GID)
        (chroot / "vmlinux").write_bytes(b"k")
        (chroot / "vmlinux").chmod(0o644)
        (chroot / "disk.img").write_bytes(b"")
        os.chown(chroot / "disk.img", VMM_UID, VMM_GID)
        (chroot / "disk.img").chmod(0o600)
        (chroot / "secret.img").write_bytes(b"")
        (chroot / "secret.img").chmod(0o600)  # root's: the VMM account cannot open it
        yield chroot


@pytest.fixture
def fc(jail: Path) -> Iterator[Standin]:
    standin = Standin(jail)
    try:
        yield standin
    finally:
        standin.stop()


def fault(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    return str(response.json()["fault_message"])


def drive(drive_id: str = "rw", path: str = "/disk.img", **over: Any) -> dict[str, Any]:
    return {"drive_id": drive_id, "path_on_host": path, "is_root_device": False,
            "is_read_only": False, **over}


def boot(fc: Standin) -> None:
    assert fc.call("PUT", "/boot-source", {"kernel_image_path": "/vmlinux"}).status_code == 204
    assert fc.call("PUT", "/actions", {"action_type": "InstanceStart"}).status_code == 204


# ---------------------------------------------------------------------------- document


def test_the_document_is_firecrackers():
    assert DOC.version.startswith("1.")
    ops = {op.operation_id for op in DOC.operations}
    assert {"putMachineConfiguration", "putGuestBootSource", "putGuestDriveByID",
            "putGuestVsock", "putGuestNetworkInterfaceByID", "createSyncAction"} <= ops


def test_pre_and_post_boot_rules_are_read_from_the_document():
    pre = {op.operation_id for op in DOC.operations if op.pre_boot}
    post = {op.operation_id for op in DOC.operations if op.post_boot}
    assert {"putGuestBootSource", "putGuestDriveByID", "putMachineConfiguration",
            "patchMachineConfiguration", "putGuestVsock", "putGuestNetworkInterfaceByID",
            "putBalloon", "putCpuConfiguration", "loadSnapshot", "putEntropyDevice",
            "putMmdsConfig", "putGuestPmemByID"} == pre
    assert {"patchGuestDriveByID", "patchGuestNetworkInterfaceByID", "patchGuestPmemByID",
            "createSnapshot"} == post
    assert not pre & post


# ---------------------------------------------------------------------------- answers


def test_it_answers_like_firecracker(fc: Standin):
    info = fc.call("GET", "/")
    assert info.status_code == 200
    DOC.validator({"$ref": "#/definitions/InstanceInfo"}).validate(info.json())
    assert info.json()["state"] == "Not started"
    assert info.json()["id"] == "vm-1"
    ok = fc.call("PUT", "/machine-config", {"vcpu_count": 2, "mem_size_mib": 256})
    assert ok.status_code == 204
    assert ok.content == b""
    assert fc.call("GET", "/machine-config").json() == {
        "vcpu_count": 2, "mem_size_mib": 256, "smt": False, "track_dirty_pages": False,
        "huge_pages": "None"}
    # the API socket belongs to the VMM account, as Firecracker running as it makes it
    assert (fc.sock.stat().st_uid, fc.sock.stat().st_gid) == (VMM_UID, VMM_GID)


@pytest.mark.parametrize(("body", "words"), [
    ({"vcpu_count": 0, "mem_size_mib": 128}, "vcpu_count: 0 is less than the minimum of 1"),
    ({"vcpu_count": 33, "mem_size_mib": 128}, "vcpu_count: 33 is greater than the maximum"),
    ({"vcpu_count": "2", "mem_size_mib": 128}, "vcpu_count: '2' is not of type 'integer'"),
    ({"vcpu_count": 1}, "'mem_size_mib' is a required property"),
    ({"vcpu_count": 1, "mem_size_mib": 128, "colour": "blue"}, "'colour' was unexpected"),
    ({"vcpu_count": 1, "mem_size_mib": 128, "huge_pages": "1G"}, "huge_pages: '1G' is not one"),
    ({"vcpu_count": 3, "mem_size_mib": 128, "smt": True}, "only be 1 or an even number"),
])
def test_invalid_machine_config_is_refused(fc: Standin, body: dict[str, Any], words: str):
    assert words in fault(fc.call("PUT", "/machine-config", body))


def test_unknown_fields_are_refused_in_nested_objects_too(fc: Standin):
    body = drive(rate_limiter={"bandwidth": {"size": 1, "refill_time": 1, "burst": 2}})
    assert "'burst' was unexpected" in fault(fc.call("PUT", "/drives/rw", body))


@pytest.mark.parametrize(("method", "path", "body", "words"), [
    ("PUT", "/machine", {"x": 1}, "Invalid request method and/or path: PUT /machine."),
    ("DELETE", "/machine-config", None, "Invalid request method and/or path"),
    ("PUT", "/machine-config", None, "Empty PUT request."),
    ("PUT", "/actions", {"action_type": "Reboot"}, "'Reboot' is not one of"),
    ("PUT", "/drives/rw-1", drive("rw-1"), "can only contain alphanumeric characters and "
                                           "underscores"),
    ("PUT", "/drives/rw", drive("other"), "id from the path does not match"),
    ("PUT", "/drives/rw", {"drive_id": "rw", "path_on_host": "/disk.img",
                           "is_root_device": False}, "is_read_only is required"),
    ("PUT", "/drives/rw", drive(path="/missing.img"), "No such file or directory"),
    ("PUT", "/drives/rw", drive(path="/secret.img", is_read_only=True), "Permission denied"),
    ("PUT", "/drives/rw", drive(path="/vmlinux"), "Permission denied"),  # RW on a 0644 file
    ("PUT", "/boot-source", {"kernel_image_path": "/nope"}, "No such file"),
    ("PUT", "/network-interfaces/eth0", {"iface_id": "eth0", "host_dev_name":
                                         "a-very-long-tap-name"}, "Could not open TAP"),
    ("PUT", "/network-interfaces/eth0", {"iface_id": "eth0", "host_dev_name": "tap0",
                                         "guest_mac": "06:00:zz:00:00:01"}, "invalid MAC"),
    ("PUT", "/vsock", {"guest_cid": 2, "uds_path": "/run/v.sock"}, "less than the minimum"),
])
def test_bad_requests_are_refused(fc: Standin, method: str, path: str, body: Any, words: str):
    assert words in fault(fc.call(method, path, body))


def test_bodies_that_are_not_json_are_refused(fc: Standin):
    assert "deserializing the json body" in fault(
        fc.call("PUT", "/machine-config", raw=b"{vcpu_count: 1}"))


def test_a_second_root_device_is_refused_and_the_root_goes_first(fc: Standin, jail: Path):
    (jail / "b.img").write_bytes(b"")
    (jail / "b.img").chmod(0o644)
    assert fc.call("PUT", "/drives/a", drive("a", is_read_only=True)).status_code == 204
    assert fc.call("PUT", "/drives/b", drive("b", "/b.img", is_read_only=True,
                                             is_root_device=True)).status_code == 204
    assert "A root block device already exists" in fault(fc.call(
        "PUT", "/drives/a", drive("a", is_read_only=True, is_root_device=True)))
    ids = [d["drive_id"] for d in fc.call("GET", "/vm/config").json()["drives"]]
    assert ids == ["b", "a"]


# ---------------------------------------------------------------------------- ordering


def test_instance_start_needs_a_kernel(fc: Standin):
    assert "without kernel configuration" in fault(
        fc.call("PUT", "/actions", {"action_type": "InstanceStart"}))


def test_pre_boot_resources_are_refused_after_instance_start(fc: Standin):
    assert fc.call("PUT", "/drives/rw", drive()).status_code == 204
    boot(fc)
    assert fc.call("GET", "/").json()["state"] == "Running"
    for method, path, body in (
            ("PUT", "/drives/rw", drive()),
            ("PUT", "/machine-config", {"vcpu_count": 1, "mem_size_mib": 128}),
            ("PUT", "/boot-source", {"kernel_image_path": "/vmlinux"}),
            ("PUT", "/vsock", {"guest_cid": 3, "uds_path": "/run/v.sock"}),
            ("PUT", "/actions", {"action_type": "InstanceStart"})):
        assert "not supported after starting the microVM" in fault(fc.call(method, path, body))


def test_post_boot_updates_are_refused_before_instance_start(fc: Standin):
    assert "not supported before starting the microVM" in fault(
        fc.call("PATCH", "/drives/rw", {"drive_id": "rw", "path_on_host": "/disk.img"}))
    assert "not supported before starting" in fault(
        fc.call("PUT", "/actions", {"action_type": "SendCtrlAltDel"}))


def test_every_call_is_recorded(fc: Standin):
    fc.call("PUT", "/machine-config", {"vcpu_count": 1, "mem_size_mib": 128})
    fc.call("PUT", "/machine-config", {"vcpu_count": 0, "mem_size_mib": 128})
    calls = fc.calls()
    assert [(c["method"], c["path"], c["status"]) for c in calls] == [
        ("PUT", "/machine-config", 204), ("PUT", "/machine-config", 400)]
    assert calls[0]["body"] == {"vcpu_count": 1, "mem_size_mib": 128}
    assert "minimum" in calls[1]["fault_message"]


# ---------------------------------------------------------------------------- vsock


@contextlib.contextmanager
def echo_server(path: Path) -> Iterator[None]:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(4)

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = srv.accept()
                with conn:
                    while data := conn.recv(4096):
                        conn.sendall(data.upper())

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield
    finally:
        srv.close()


def vsock_exchange(uds: Path, command: bytes, payload: bytes = b"") -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(TIMEOUT)
        s.connect(str(uds))
        s.sendall(command + payload)
        s.shutdown(socket.SHUT_WR) if payload else None
        out = b""
        while chunk := s.recv(4096):
            out += chunk
            if not payload and out.endswith(b"\n"):
                break
        return out


def test_vsock_connect_is_forwarded_to_the_guest_port(jail: Path):
    echo = jail.parent / "echo.sock"
    with echo_server(echo):
        fc = Standin(jail, "--guest-port", f"52={echo}")
        try:
            assert fc.call("PUT", "/vsock", {"guest_cid": 3, "uds_path": "/run/v.sock"}
                           ).status_code == 204
            uds = jail / "run" / "v.sock"
            assert uds.stat().st_uid == VMM_UID  # bound at PUT time, as Firecracker does
            boot(fc)
            assert vsock_exchange(uds, b"CONNECT 52\n", b"hello") == b"OK 1073741824\nHELLO"
            # nothing listens on port 53, and a bad command: Firecracker hangs up
            assert vsock_exchange(uds, b"CONNECT 53\n") == b""
            assert vsock_exchange(uds, b"HELLO 52\n") == b""
        finally:
            fc.stop()


# ---------------------------------------------------------------------------- jailer


def jailer_argv(base: Path, exec_file: Path, **over: Any) -> list[str]:
    flags = {"--id": "vm-1", "--exec-file": str(exec_file), "--uid": str(VMM_UID),
             "--gid": str(VMM_GID), "--chroot-base-dir": str(base), **over}
    argv: list[str] = []
    for key, value in flags.items():
        if value is not None:
            argv += [key, value]
    return argv


@pytest.fixture
def jailer_tree() -> Iterator[tuple[Path, Path]]:
    with short_dir() as root:
        base = root / "base"
        base.mkdir(mode=0o700)
        exec_file = root / "firecracker"
        exec_file.write_text("#!/bin/sh\n")
        exec_file.chmod(0o755)
        yield base, exec_file


@pytest.mark.parametrize(("over", "words"), [
    ({"--uid": None}, "Missing argument: uid"),
    ({"--id": None}, "Missing argument: id"),
    ({"--id": "vm_1"}, "Invalid char (_) at position 2"),
    ({"--id": "x" * 65}, "Invalid len (65)"),
    ({"--uid": "-1"}, "Invalid uid value"),
    ({"--gid": "nobody"}, "Invalid gid value"),
    ({"--exec-file": "/nonexistent/firecracker"}, "is not a file"),
    ({"--chroot-base-dir": "/nonexistent"}, "is not a directory"),
    ({"--cgroup-version": "3"}, "invalid cgroup version"),
    ({"--parent-cgroup": "/abs"}, "should not be absolute"),
    ({"--parent-cgroup": "a/../b"}, "should not be absolute or contain '..'"),
    ({"--cgroup": "cpu.max"}, "Invalid format for cgroups"),
    ({"--resource-limit": "memory=1"}, "Invalid resource argument"),
    ({"--netns": "/nonexistent/netns"}, "Failed to open the netns file"),
    ({"--colour": "blue"}, "Found argument 'colour' which wasn't expected"),
])
def test_the_fake_jailer_applies_the_documented_rules(jailer_tree: tuple[Path, Path],
                                                      over: dict[str, Any], words: str):
    base, exec_file = jailer_tree
    def parse_and_check() -> None:
        args, _ = fake_jailer.parse(jailer_argv(base, exec_file, **over))
        fake_jailer.check(args)

    with pytest.raises(fake_jailer.JailerError) as info:
        parse_and_check()
    assert words in str(info.value)


def test_the_fake_jailer_refuses_a_flag_given_twice(jailer_tree: tuple[Path, Path]):
    base, exec_file = jailer_tree
    with pytest.raises(fake_jailer.JailerError, match="provided more than once"):
        fake_jailer.parse([*jailer_argv(base, exec_file), "--id", "vm-2"])


def test_the_fake_jailer_builds_the_jail_and_says_what_it_does_with_cgroups(
        jailer_tree: tuple[Path, Path]):
    base, exec_file = jailer_tree
    args, extra = fake_jailer.parse([*jailer_argv(base, exec_file), "--", "--api-sock",
                                     "/run/x.sock"])
    assert extra == ["--api-sock", "/run/x.sock"]
    facts = fake_jailer.check(args)
    assert facts["cgroup_action"] == "create cgroup firecracker/vm-1"  # the v1 default
    v2 = fake_jailer.check({**args, "cgroup-version": "2", "parent-cgroup": "no/such/cg"})
    assert v2["cgroup_action"] == "none"
    chroot = fake_jailer.build(facts)
    assert chroot == base / "firecracker" / "vm-1" / "root"
    assert (chroot / "firecracker").read_text() == "#!/bin/sh\n"
    for d in ("", "dev", "dev/net", "run"):
        st = (chroot / d).stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (VMM_UID, VMM_GID, 0o700)
