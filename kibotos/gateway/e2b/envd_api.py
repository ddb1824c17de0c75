"""envd's API on the sandbox URL (``E2B_SANDBOX_URL``): one server for every sandbox,
routed by the ``E2b-Sandbox-Id`` header the SDK sends, or by a host name
``<port>-<sandbox>.<domain>``.

Every call but ``/health`` must carry the sandbox's ``X-Access-Token`` (every sandbox
of this gateway is "secure"): the token is what only a key of the sandbox's team was
given, so a call without it, or with another sandbox's, is ``unauthenticated`` before
anything is looked up.  ``/health`` answers 204 while the sandbox is AVAILABLE and
502 otherwise (what the SDK's ``is_running`` reads).

The user a call acts as is envd's: ``Authorization: Basic base64("<user>:")`` (what the
SDK sends when it is given a ``user``; REST ``/files`` carries ``username`` instead);
without it, the guest agent's default user (docs/gateways.md, "Users").
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kibotos.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    KibotosError,
    NotFound,
    Unauthenticated,
)
from kibotos.dataplane.clients.user_name import check_user_name
from kibotos.gateway.e2b import envd_files
from kibotos.gateway.e2b.connect_rpc import Unimplemented, server_stream, unary, unary_error
from kibotos.gateway.e2b.ctrl_client import DataplaneSession
from kibotos.gateway.e2b.envd_process import DEFAULT_KEEPALIVE, ProcessService
from kibotos.gateway.e2b.envd_watch import WatcherTable, WatchService
from kibotos.gateway.e2b.processes import ProcessTable
from kibotos.gateway.e2b.sandboxes import workspace_id
from kibotos.gateway.e2b.service import SandboxService
from kibotos.gateway.e2b.third_party.envd import filesystem_pb2 as fs_pb
from kibotos.gateway.e2b.third_party.envd import process_pb2 as proc_pb

ENVD_PORT = "49983"
_HOST = re.compile(r"(\d{1,5})-([0-9a-z]{26})\.")


@dataclass
class SandboxCall:
    """One authorized envd call: its sandbox, default env and keepalive interval."""

    sandbox_id: str
    env_vars: dict[str, str]
    keepalive: float
    service: SandboxService
    #: The envd user (`basic_user`); None: the guest agent's default user.
    user: str | None = None

    async def session(self) -> DataplaneSession:
        """The data-plane session of an AVAILABLE sandbox; a paused one created with
        ``autoResume`` is woken first (the call waits for the boot)."""
        ws_id = workspace_id(self.sandbox_id)
        try:
            return await self.service.ctrl.session(ws_id)
        except FailedPrecondition:
            if not await self.service.wake_if_paused(self.sandbox_id):
                raise
        return await self.service.ctrl.session(ws_id)


def _sandbox_of(request: Request) -> str:
    sid = request.headers.get("e2b-sandbox-id")
    if sid is None:
        m = _HOST.match(request.headers.get("host", ""))
        if m is None or m.group(1) != ENVD_PORT:
            raise NotFound("no sandbox named: send E2b-Sandbox-Id, or use the host name "
                           f"{ENVD_PORT}-<sandbox>.<domain>")
        sid = m.group(2)
    workspace_id(sid)  # NotFound for an ID no sandbox can have
    return sid


def _keepalive(request: Request) -> float:
    text = request.headers.get("keepalive-ping-interval", "")
    return float(min(int(text), 3600)) if text.isascii() and text.isdigit() and int(text) \
        else DEFAULT_KEEPALIVE


def basic_user(request: Request) -> str | None:
    """The user of ``Authorization: Basic base64("<user>:<anything>")``, or None without
    the header; any other form is `InvalidArgument` naming the header."""
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    try:
        if scheme.lower() != "basic":
            raise ValueError
        user, colon, _ = base64.b64decode(token.strip(), validate=True).decode().partition(":")
        if not colon:
            raise ValueError
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise InvalidArgument('Authorization must be Basic base64("<user>:") (envd\'s user '
                              "selection)") from None
    return check_user_name(user, "the Authorization header's user")


def build_envd_app(service: SandboxService, processes: ProcessTable,
                   watchers: WatcherTable) -> Starlette:
    async def authorize(request: Request) -> SandboxCall:
        sid = _sandbox_of(request)
        if not service.tokens.matches(sid, request.headers.get("x-access-token")):
            raise Unauthenticated(f"sandbox {sid}: missing or wrong X-Access-Token")
        record = service.records.get(sid)
        return SandboxCall(sid, dict(record.env_vars) if record else {},
                           _keepalive(request), service, user=basic_user(request))

    def rest(handler: Callable[[Request, SandboxCall], Awaitable[Response]]
             ) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            try:
                return await handler(request, await authorize(request))
            except KibotosError as exc:
                return envd_files.rest_error(exc)

        return run

    async def health(request: Request) -> Response:
        try:
            ws = await service.ctrl.workspace(workspace_id(_sandbox_of(request)))
        except KibotosError:
            return Response(status_code=502)
        return Response(status_code=204 if ws["state"] == "AVAILABLE" else 502)

    async def envs(request: Request, call: SandboxCall) -> Response:
        return JSONResponse(call.env_vars)

    async def not_served(request: Request) -> Response:
        return unary_error(Unimplemented(
            f"{request.url.path.strip('/')} is not served by this kibotos gateway"))

    procs, fs = ProcessService(processes), envd_files.FilesystemService()
    watch = WatchService(watchers)
    rpc: list[tuple[str, Any]] = [
        ("process.Process/Start", server_stream(proc_pb.StartRequest, authorize, procs.start)),
        ("process.Process/Connect",
         server_stream(proc_pb.ConnectRequest, authorize, procs.connect)),
        ("process.Process/List", unary(proc_pb.ListRequest, authorize, procs.list)),
        ("process.Process/SendInput",
         unary(proc_pb.SendInputRequest, authorize, procs.send_input)),
        ("process.Process/CloseStdin",
         unary(proc_pb.CloseStdinRequest, authorize, procs.close_stdin)),
        ("process.Process/SendSignal",
         unary(proc_pb.SendSignalRequest, authorize, procs.send_signal)),
        ("process.Process/Update", unary(proc_pb.UpdateRequest, authorize, procs.update)),
        ("filesystem.Filesystem/Stat", unary(fs_pb.StatRequest, authorize, fs.stat)),
        ("filesystem.Filesystem/MakeDir",
         unary(fs_pb.MakeDirRequest, authorize, fs.make_dir)),
        ("filesystem.Filesystem/Move", unary(fs_pb.MoveRequest, authorize, fs.move)),
        ("filesystem.Filesystem/ListDir",
         unary(fs_pb.ListDirRequest, authorize, fs.list_dir)),
        ("filesystem.Filesystem/Remove", unary(fs_pb.RemoveRequest, authorize, fs.remove)),
        ("filesystem.Filesystem/WatchDir",
         server_stream(fs_pb.WatchDirRequest, authorize, watch.watch_dir)),
        ("filesystem.Filesystem/CreateWatcher",
         unary(fs_pb.CreateWatcherRequest, authorize, watch.create_watcher)),
        ("filesystem.Filesystem/GetWatcherEvents",
         unary(fs_pb.GetWatcherEventsRequest, authorize, watch.get_watcher_events)),
        ("filesystem.Filesystem/RemoveWatcher",
         unary(fs_pb.RemoveWatcherRequest, authorize, watch.remove_watcher)),
    ]
    routes = [Route(f"/{path}", endpoint, methods=["POST"]) for path, endpoint in rpc]
    routes += [Route("/process.Process/StreamInput", not_served, methods=["POST"])]
    routes += [
        Route("/health", health, methods=["GET"]),
        Route("/envs", rest(envs), methods=["GET"]),
        Route("/files", rest(envd_files.download), methods=["GET"]),
        Route("/files", rest(envd_files.upload), methods=["POST"]),
    ]
    return Starlette(routes=routes)
