"""The Exposure gateway's parts, fast and without a cluster: routing by host name and
by header, the traffic-token labels, and the configuration."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from kibotos import config as config_mod
from kibotos.core.errors import InvalidArgument, NotFound
from kibotos.gateway.common.sandbox_labels import (
    TRAFFIC_LABEL,
    traffic_allowed,
    traffic_digest,
)
from kibotos.gateway.e2b.wire import NewSandbox
from kibotos.gateway.exposure.config import ExposureConfig
from kibotos.gateway.exposure.routing import Target, target_of

SID = "01m8t2krfny6fp0sctgh9wk6aa"


def _route(domain: str | None = None, **headers: str) -> Target:
    return target_of([(k.lower().encode(), v.encode()) for k, v in headers.items()], domain)


def test_a_host_name_names_port_and_sandbox() -> None:
    assert _route(host=f"8080-{SID}.sandbox.example") == Target(SID, 8080)
    assert _route(host=f"8080-{SID}.sandbox.example:3002") == Target(SID, 8080)
    assert _route("sandbox.example", host=f"80-{SID}.sandbox.example") == Target(SID, 80)
    assert _route(host=f"80-{SID.upper()}.Sandbox.Example") == Target(SID, 80)
    assert Target(SID, 80).workspace_id == f"ws-{SID}"
    for host in (f"80-{SID}.other.example", "sandbox.example", f"{SID}.sandbox.example",
                 f"80-{SID[:-1]}.sandbox.example", ""):
        with pytest.raises(NotFound):
            _route("sandbox.example", host=host)
    for bad in ("0", "65536", "080"):
        with pytest.raises(InvalidArgument, match="from 1 to 65535"):
            _route(host=f"{bad}-{SID}.sandbox.example")


def test_the_header_form_wins_and_must_be_whole() -> None:
    headers = {"host": "127.0.0.1:3002", "e2b-sandbox-id": SID, "e2b-sandbox-port": "3000"}
    assert _route("sandbox.example", **headers) == Target(SID, 3000)
    with pytest.raises(InvalidArgument, match="both"):
        _route(**{"host": f"80-{SID}.x", "e2b-sandbox-id": SID})
    with pytest.raises(NotFound):
        _route(**{"e2b-sandbox-id": "ws-x", "e2b-sandbox-port": "80"})
    with pytest.raises(InvalidArgument):
        _route(**{"e2b-sandbox-id": SID, "e2b-sandbox-port": "http"})


def test_traffic_is_public_unless_a_digest_label_says_otherwise() -> None:
    token = "t" * 43
    digest = traffic_digest(token)
    assert len(digest) == 52
    assert digest.isalnum()
    assert digest == digest.lower()
    assert traffic_allowed({"e2b.team": "blue"}, None)
    private = {"e2b.team": "blue", TRAFFIC_LABEL: digest}
    assert traffic_allowed(private, token)
    assert not traffic_allowed(private, None)
    assert not traffic_allowed(private, token + "x")
    assert NewSandbox.model_validate({"templateID": "base"}).public_traffic()
    private_body = NewSandbox.model_validate(
        {"templateID": "base", "network": {"allowPublicTraffic": False}})
    assert not private_body.public_traffic()
    assert private_body.unsupported() == []


def test_config_is_strict(tmp_path: Path) -> None:
    cred = tmp_path / "cred"
    cred.write_text("kid-x:secret\n")
    cred.chmod(0o600)
    base = {"state_dir": str(tmp_path / "state"),
            "ctrl": {"url": "http://127.0.0.1:1", "credential_file": str(cred)}}
    cfg = config_mod.parse(ExposureConfig, {**base, "domain": "sandbox.example"}, "x.toml")
    assert cfg.read_credential() == "kid-x:secret"
    assert cfg.limits.max_connections == 1024
    for extra in ({"domain": "Sandbox.Example"}, {"domain": ".x"}, {"listen": "nowhere"},
                  {"limits": {"idle_timeout_s": "5"}}, {"unknown": 1},
                  {"tls": {"cert_file": "/x"}}):
        with pytest.raises((ValidationError, InvalidArgument)):
            config_mod.parse(ExposureConfig, {**base, **extra}, "x.toml")
    # Plain HTTP only on loopback: traffic tokens cross the listener.
    with pytest.raises(InvalidArgument, match="not a loopback address"):
        config_mod.parse(ExposureConfig, {**base, "listen": "0.0.0.0:3002"}, "x.toml")
    tls = {"cert_file": str(tmp_path / "none.crt"), "key_file": str(tmp_path / "none.key")}
    public = config_mod.parse(ExposureConfig, {**base, "listen": "0.0.0.0:3002", "tls": tls},
                              "x.toml")
    assert public.tls is not None
    with pytest.raises(InvalidArgument, match=r"tls\.cert_file"):
        public.tls.context()


def test_serve_refuses_a_bad_config_before_it_listens(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kibotos.cli.main import kibotos_cli

    def serve(text: str) -> tuple[int, str]:
        config = tmp_path / "gateway.toml"
        config.write_text(text)
        result = CliRunner().invoke(kibotos_cli, ["gateway", "exposure", "serve",
                                                  "--config", str(config)])
        return result.exit_code, result.output

    ctrl = f'[ctrl]\nurl = "http://127.0.0.1:1"\ncredential_file = "{tmp_path / "none"}"\n'
    code, output = serve(f'state_dir = "{tmp_path}"\nlisten = "0.0.0.0:3002"\n{ctrl}')
    assert code == 10, output
    assert "not a loopback address" in output
    code, output = serve(f'state_dir = "{tmp_path}"\n{ctrl}')
    assert code == 13, output
    assert "credential file" in output
    assert not (tmp_path / "listen-address").exists()
