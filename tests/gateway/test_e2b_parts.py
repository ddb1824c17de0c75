"""The E2B gateway's parts, fast and without a cluster: sandbox and Workspace IDs, the
envd access tokens, the sandbox records, strict request bodies, the configuration, and
the Connect protocol (unary and streamed, JSON and binary) through a real Starlette app
with the generated envd messages."""

from __future__ import annotations

import json
import ssl
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route

from kibotos import config as config_mod
from kibotos.core.errors import FailedPrecondition, InvalidArgument, NotFound, Unauthenticated
from kibotos.gateway.e2b.config import GatewayConfig
from kibotos.gateway.e2b.connect_rpc import END_STREAM, envelope, server_stream, unary
from kibotos.gateway.e2b.sandboxes import (
    AccessTokens,
    Records,
    SandboxRecord,
    sandbox_id,
    workspace_id,
)
from kibotos.gateway.e2b.third_party.envd import process_pb2 as pb
from kibotos.gateway.e2b.wire import NewSandbox

SID = "01m8t2krfny6fp0sctgh9wk6aa"


def test_sandbox_ids_are_workspace_ids_without_their_prefix() -> None:
    assert workspace_id(SID) == f"ws-{SID}"
    assert sandbox_id(f"ws-{SID}") == SID
    for bad in ("ws-" + SID, SID.upper(), SID[:-1], "../x", ""):
        with pytest.raises(NotFound):
            workspace_id(bad)


def test_access_tokens_are_per_sandbox_and_survive_a_restart(tmp_path: Path) -> None:
    tokens = AccessTokens(tmp_path)
    token = tokens.token(SID)
    assert (tmp_path / "token.key").stat().st_mode & 0o777 == 0o600
    assert AccessTokens(tmp_path).token(SID) == token
    assert tokens.token("0" * 26) != token
    assert tokens.matches(SID, token)
    assert not tokens.matches(SID, None)
    assert not tokens.matches(SID, token[:-1] + "x")
    assert not tokens.matches("0" * 26, token)
    (tmp_path / "other").mkdir()
    assert AccessTokens(tmp_path / "other").token(SID) != token


def test_records_are_written_through_and_read_back(tmp_path: Path) -> None:
    records = Records(tmp_path)
    record = SandboxRecord(SID, "blue", "base", {"User Id": "ü 1"}, {"A": "b"}, 12.5,
                           "pause", True)
    records.put(record)
    assert (tmp_path / "sandboxes" / f"{SID}.json").stat().st_mode & 0o777 == 0o600
    assert Records(tmp_path).get(SID) == record
    records.drop(SID)
    assert Records(tmp_path).get(SID) is None
    (tmp_path / "sandboxes" / "bad.json").write_text(json.dumps({"format": 9}))
    with pytest.raises(FailedPrecondition, match="format"):
        Records(tmp_path)


def test_create_bodies_are_strict_and_unsupported_options_are_named() -> None:
    assert NewSandbox.model_validate({"templateID": "base"}).unsupported() == []
    for body in ({"templateID": "base", "timeout": "5"}, {"templateID": "base", "x": 1},
                 {"templateID": 3}, {"templateID": "base", "metadata": {"k": 1}}):
        with pytest.raises(ValidationError):
            NewSandbox.model_validate(body)
    asked = NewSandbox.model_validate({
        "templateID": "base", "mcp": {}, "volumeMounts": [{"name": "v", "path": "/v"}],
        "autoPauseMemory": True, "network": {
            "egressProxy": {"address": "socks.test:1080", "tls": True},
            "allowOut": ["1.2.3.4/32"], "rules": {}}})
    assert asked.unsupported() == ["autoPauseMemory (memory snapshots)", "mcp",
                                   "volumeMounts", "network.rules",
                                   "network.egressProxy.tls (TLS to the SOCKS5 server)"]
    resuming = NewSandbox.model_validate({"templateID": "base", "autoPause": True,
                                          "autoResume": {"enabled": True}})
    assert resuming.unsupported() == []
    assert resuming.auto_resumes() is True
    assert NewSandbox.model_validate({"templateID": "base", "autoPause": True,
                                      "autoResume": {"enabled": False}}).auto_resumes() is False
    assert NewSandbox.model_validate({"templateID": "base"}).auto_resumes() is False
    for refused, why in (({"autoResume": {"enabled": True}}, "needs autoPause"),
                         ({"autoResume": {"enabled": True}, "autoPause": True,
                           "autoPauseMemory": False}, "autoPauseMemory false")):
        with pytest.raises(InvalidArgument, match=why):
            NewSandbox.model_validate({"templateID": "base", **refused}).auto_resumes()
    proxied = {"templateID": "base", "network": {"egressProxy": {"address": "s.test:1080"}}}
    assert NewSandbox.model_validate(proxied).unsupported() == []
    with pytest.raises(ValidationError):  # a proxy needs its address
        NewSandbox.model_validate({"templateID": "base", "network": {"egressProxy": {}}})


def _config(tmp_path: Path, **extra: Any) -> GatewayConfig:
    cred = tmp_path / "cred"
    cred.write_text("kid-x:secret\n")
    cred.chmod(0o600)
    data = {"state_dir": str(tmp_path / "state"),
            "ctrl": {"url": "http://127.0.0.1:1/", "credential_file": str(cred)},
            "templates": {"base": "kibotos-base"}, **extra}
    return config_mod.parse(GatewayConfig, data, "gateway.toml")


def test_config_aliases_credential_and_strictness(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    assert cfg.ctrl.url == "http://127.0.0.1:1"
    assert cfg.template_for("base") == "kibotos-base"
    assert cfg.template_for("tiny") == "tiny"
    assert cfg.read_credential() == "kid-x:secret"
    cfg.ctrl.credential_file.chmod(0o644)
    with pytest.raises(FailedPrecondition, match="chmod 600"):
        cfg.read_credential()
    for bad in ({"listen": "nowhere"}, {"templates": {"base": "Bad Name"}},
                {"sandbox": {"default_timeout_s": "300"}}, {"extra": 1}):
        with pytest.raises(InvalidArgument):
            _config(tmp_path, **bad)


def test_config_ctrl_tls(tmp_path: Path) -> None:
    """ctrl is verified against [ctrl] ca_file; plain http only to loopback."""
    from kibotos.tls.ca import ClusterCA, cert_path

    cred = tmp_path / "cred"
    cred.write_text("kid-x:secret\n")
    cred.chmod(0o600)

    def ctrl(**section: str) -> GatewayConfig:
        data = {"state_dir": str(tmp_path / "state"),
                "ctrl": {"credential_file": str(cred), **section}}
        return config_mod.parse(GatewayConfig, data, "gateway.toml")

    with pytest.raises(InvalidArgument, match="must be https"):
        ctrl(url="http://ctrl.example:7400")
    missing = ctrl(url="https://ctrl.example:7400", ca_file=str(tmp_path / "none.crt"))
    with pytest.raises(InvalidArgument, match=r"ctrl\.ca_file"):
        missing.ctrl.tls()
    ClusterCA.load_or_create(tmp_path / "ca")
    pinned = ctrl(url="https://ctrl.example:7400", ca_file=str(cert_path(tmp_path / "ca")))
    context = pinned.ctrl.tls()
    assert context.check_hostname
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert len(context.get_ca_certs()) == 1  # the pinned CA only, not the system store
    # The data planes: ca_file unless dataplane_ca_file names another (ctrl with an
    # operator's certificate); a missing one is an error naming it.
    assert pinned.ctrl.dataplane_tls().get_ca_certs() == context.get_ca_certs()
    ClusterCA.load_or_create(tmp_path / "cluster")
    other = ctrl(url="https://ctrl.example:7400", ca_file=str(cert_path(tmp_path / "ca")),
                 dataplane_ca_file=str(cert_path(tmp_path / "cluster")))
    assert other.ctrl.dataplane_tls().get_ca_certs() != context.get_ca_certs()
    assert len(other.ctrl.dataplane_tls().get_ca_certs()) == 1
    gone = ctrl(url="https://ctrl.example:7400", dataplane_ca_file=str(tmp_path / "x.crt"))
    with pytest.raises(InvalidArgument, match=r"ctrl\.dataplane_ca_file"):
        gone.ctrl.dataplane_tls()


async def _auth(request: Request) -> str:
    if request.headers.get("x-access-token") != "ok":
        raise Unauthenticated("no token")
    return "ctx"


async def _list(message: pb.ListRequest, ctx: str) -> pb.ListResponse:
    return pb.ListResponse(processes=[pb.ProcessInfo(pid=7, config=pb.ProcessConfig(
        cmd="sleep", args=["1"], envs={"A": "b"}))])


async def _start(message: pb.StartRequest, ctx: str) -> AsyncIterator[pb.StartResponse]:
    yield pb.StartResponse(event=pb.ProcessEvent(start=pb.ProcessEvent.StartEvent(pid=9)))
    yield pb.StartResponse(event=pb.ProcessEvent(
        data=pb.ProcessEvent.DataEvent(stdout=message.process.cmd.encode())))
    raise NotFound("the process went away")


@pytest.fixture
async def rpc() -> AsyncIterator[httpx.AsyncClient]:
    app = Starlette(routes=[
        Route("/process.Process/List", unary(pb.ListRequest, _auth, _list), methods=["POST"]),
        Route("/process.Process/Start", server_stream(pb.StartRequest, _auth, _start),
              methods=["POST"])])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        yield client


def _frames(body: bytes) -> list[tuple[int, bytes]]:
    out = []
    while body:
        flags, size = struct.unpack_from(">BI", body)
        out.append((flags, body[5:5 + size]))
        body = body[5 + size:]
    return out


async def test_connect_unary_in_json_and_binary(rpc: httpx.AsyncClient) -> None:
    ok = {"x-access-token": "ok"}
    r = await rpc.post("/process.Process/List", json={}, headers=ok)
    assert r.status_code == 200
    assert r.json() == {"processes": [{"config": {"cmd": "sleep", "args": ["1"],
                                                  "envs": {"A": "b"}}, "pid": 7}]}
    r = await rpc.post("/process.Process/List", content=b"",
                       headers={**ok, "content-type": "application/proto"})
    assert pb.ListResponse.FromString(r.content).processes[0].pid == 7
    r = await rpc.post("/process.Process/List", json={})
    assert (r.status_code, r.json()) == (401, {"code": "unauthenticated",
                                               "message": "no token"})
    r = await rpc.post("/process.Process/List", content=b"{", headers={
        **ok, "content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["code"] == "invalid_argument"


async def test_connect_server_stream_ends_with_the_error(rpc: httpx.AsyncClient) -> None:
    request = json.dumps({"process": {"cmd": "echo"}}).encode()
    r = await rpc.post("/process.Process/Start", content=envelope(request), headers={
        "content-type": "application/connect+json", "x-access-token": "ok"})
    assert r.status_code == 200
    frames = _frames(r.content)
    assert [f for f, _ in frames] == [0, 0, END_STREAM]
    assert json.loads(frames[0][1]) == {"event": {"start": {"pid": 9}}}
    assert json.loads(frames[1][1]) == {"event": {"data": {"stdout": "ZWNobw=="}}}
    assert json.loads(frames[2][1]) == {"error": {"code": "not_found",
                                                  "message": "the process went away"}}
    r = await rpc.post("/process.Process/Start", content=envelope(request), headers={
        "content-type": "application/connect+json"})
    assert _frames(r.content) == [(END_STREAM, json.dumps({"error": {
        "code": "unauthenticated", "message": "no token"}}).encode())]


def test_serve_refuses_a_bad_config_before_it_listens(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kibotos.cli.main import kibotos_cli

    bad = tmp_path / "gateway.toml"
    bad.write_text('state_dir = "/tmp/x"\nlisten = 3000\n[ctrl]\nurl = "ftp://x"\n'
                   'credential_file = "/nonexistent"\n')
    result = CliRunner().invoke(kibotos_cli, ["gateway", "e2b", "serve", "--config", str(bad)])
    assert result.exit_code == 10, result.output
    assert "listen" in result.output
    assert "ctrl.url" in result.output
    good = tmp_path / "ok.toml"
    good.write_text(f'state_dir = "{tmp_path / "s"}"\n[ctrl]\nurl = "http://127.0.0.1:1"\n'
                    f'credential_file = "{tmp_path / "missing"}"\n')
    result = CliRunner().invoke(kibotos_cli, ["gateway", "e2b", "serve", "--config", str(good)])
    assert result.exit_code == 13, result.output
    assert "credential file" in result.output
