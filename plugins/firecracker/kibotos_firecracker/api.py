"""Firecracker's HTTP API on its unix socket: the configuration calls of one launch, and
a small client that turns Firecracker's refusals into the SDK's errors.

The calls follow Firecracker's OpenAPI document (``src/firecracker/swagger/
firecracker.yaml``; a copy is in ``tests/firecracker/swagger/`` where the stand-in
validates against it).  Every resource below is "pre-boot only", so all of them come
before ``InstanceStart``; the order among them is free, and this one reads like the VM
is built: machine, boot source, disks, vsock, balloon, network.  Firecracker answers
204 with no body on success and 400 with ``{"fault_message": …}`` when it refuses.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from kibotos.sdk import DeadlineExceeded, FailedPrecondition, Internal, Unavailable
from kibotos_firecracker import jail as jailmod
from kibotos_firecracker.launch import Launch

#: Firecracker's recommended x86 arguments (``reboot=k``: a guest reboot resets the
#: i8042, which ends Firecracker; ``pci=off``: devices are virtio-mmio), with
#: ``panic=-1`` as under qemu so a dead guest init ends the VMM and hence the unit.
BASE_BOOT_ARGS = ("console=ttyS0", "reboot=k", "panic=-1", "pci=off", "quiet")
#: How often a socket that is not there yet is tried again.
_RETRY = 0.05


@dataclass(frozen=True)
class ApiCall:
    method: str
    path: str
    body: Mapping[str, Any] | None = None

    def describe(self) -> str:
        return f"{self.method} {self.path}"


def boot_args(launch: Launch, serials: Mapping[str, str], vsock_port: int) -> str:
    """The kernel command line: Firecracker's basics, then the Platform init's
    ``kibotos.*`` parameters (docs/vm.md), then the launch's own arguments."""
    args = list(BASE_BOOT_ARGS)
    args += [f"kibotos.root={serials['root']}", f"kibotos.rw={serials['rw']}",
             f"kibotos.disks={2 + len(launch.volumes)}", f"kibotos.vsock={vsock_port}"]
    if launch.taps:  # the init loads virtio-net only then
        args.append("kibotos.net=1")
    args += launch.kernel_args
    return " ".join(args)


def launch_calls(launch: Launch, files: Sequence[jailmod.JailFile],
                 serials: Mapping[str, str], *, vsock_port: int, guest_cid: int,
                 balloon: bool) -> list[ApiCall]:
    """Every API call that configures and starts the microVM of `launch`, in order."""
    calls = [
        ApiCall("PUT", "/machine-config", {
            "vcpu_count": launch.vcpus,
            "mem_size_mib": launch.memory_mib,
            "smt": False,
            "track_dirty_pages": False,
        }),
        ApiCall("PUT", "/boot-source", {
            "kernel_image_path": jailmod.KERNEL,
            "initrd_path": jailmod.INITRAMFS,
            "boot_args": boot_args(launch, serials, vsock_port),
        }),
    ]
    for f in files:
        if f.drive_id is None:
            continue
        calls.append(ApiCall("PUT", f"/drives/{f.drive_id}", {
            "drive_id": f.drive_id,
            "path_on_host": f.jail_path,
            # The initramfs builds the root; is_root_device would add root=/dev/vda.
            "is_root_device": False,
            "is_read_only": not f.writable,
            # Unsafe: a guest flush is not a host fsync (spec, storage pools, Notes: both
            # backends give a guest fsync the host page cache, no COMMIT per fsync on
            # NFS); the node fsyncs the block file when it releases or fences it.
            "cache_type": "Unsafe",
            # Sync, not Async: Async is io_uring, and the spec keeps Firecracker at the
            # default LimitMEMLOCK because it does not use io_uring.
            "io_engine": "Sync",
        }))
    calls.append(ApiCall("PUT", "/vsock", {"guest_cid": guest_cid,
                                           "uds_path": jailmod.VSOCK_SOCKET}))
    if balloon:
        # As under qemu: free page reporting is how used guest memory returns to the
        # host.  The balloon itself stays empty (amount 0).
        calls.append(ApiCall("PUT", "/balloon", {"amount_mib": 0, "deflate_on_oom": True,
                                                 "free_page_reporting": True}))
    for i, tap in enumerate(launch.taps):
        iface: dict[str, Any] = {"iface_id": f"eth{i}", "host_dev_name": tap.host_dev_name}
        if tap.guest_mac is not None:
            iface["guest_mac"] = tap.guest_mac
        if tap.mtu is not None:
            iface["mtu"] = tap.mtu
        calls.append(ApiCall("PUT", f"/network-interfaces/eth{i}", iface))
    calls.append(ApiCall("PUT", "/actions", {"action_type": "InstanceStart"}))
    return calls


class FirecrackerApi:
    """One Firecracker's API, all calls bounded by one deadline (trio time)."""

    def __init__(self, socket_path: Path, deadline: float) -> None:
        self.socket_path = socket_path
        self.deadline = deadline
        self._client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=str(socket_path)),
            base_url="http://localhost")

    async def __aenter__(self) -> FirecrackerApi:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.aclose()

    def _timeout(self) -> float:
        return max(0.01, self.deadline - trio.current_time())

    async def call(self, call: ApiCall) -> Any:
        """Send `call`; the decoded answer (None for 204).  Refusals are
        FailedPrecondition naming the call and Firecracker's ``fault_message``."""
        what = call.describe()
        content = None if call.body is None else json.dumps(call.body).encode()
        headers = {"Accept": "application/json"}
        if content is not None:
            headers["Content-Type"] = "application/json"
        with trio.move_on_at(self.deadline) as scope:
            try:
                response = await self._client.request(
                    call.method, call.path, content=content, headers=headers,
                    timeout=self._timeout())
            except httpx.TimeoutException as exc:
                raise DeadlineExceeded(f"firecracker API {what}: no answer before the "
                                       f"deadline ({exc})") from exc
            except httpx.TransportError as exc:
                raise Unavailable(f"firecracker API {what} on {self.socket_path}: "
                                  f"{exc}") from exc
        if scope.cancelled_caught:
            raise DeadlineExceeded(f"firecracker API {what}: no answer before the deadline")
        return self._answer(call, response)

    @staticmethod
    def _answer(call: ApiCall, response: httpx.Response) -> Any:
        what = call.describe()
        status = response.status_code
        body: Any = None
        if response.content:
            try:
                body = response.json()
            except ValueError:
                body = None
        if 200 <= status < 300:
            return body
        fault = body.get("fault_message") if isinstance(body, dict) else None
        fault = str(fault) if fault is not None else response.text.strip()[:500]
        details = {"call": what, "status": status, "fault_message": fault}
        if 400 <= status < 500:
            raise FailedPrecondition(f"firecracker refused {what} ({status}): {fault}",
                                     details=details)
        raise Internal(f"firecracker failed {what} ({status}): {fault}", details=details)

    async def wait_answering(self) -> Mapping[str, Any]:
        """``GET /`` (the instance info) once Firecracker answers; retries while the
        socket is missing or refused (the jailer is still building the jail)."""
        last: object = "no answer to GET /"
        while True:
            try:
                info = await self.call(ApiCall("GET", "/"))
            except Unavailable as exc:
                last = exc
            except DeadlineExceeded:
                break
            else:
                if not isinstance(info, Mapping) or "state" not in info:
                    raise Internal(f"firecracker API GET /: unexpected answer {info!r}")
                return info
            now = trio.current_time()
            if now >= self.deadline:
                break
            await trio.sleep(min(_RETRY, self.deadline - now))
        raise DeadlineExceeded(f"firecracker API on {self.socket_path} did not answer "
                               f"before the deadline: {last}")

    async def run(self, calls: Sequence[ApiCall]) -> None:
        for call in calls:
            await self.call(call)
