"""The official E2B SDK (``e2b==2.63.0`` from PyPI, unchanged) against the gateway and
a dev cluster: create with metadata and envs, commands (output, exit codes and
CommandExitException, envs, cwd, streaming, background with list and kill, stdin),
files (text, 8 MiB of random bytes, list, exists, make_dir, rename, remove, watch_dir
with the sync and the async SDK), info,
list with a metadata filter, timeouts, kill; and team isolation: another team's key
cannot see, connect to, run in or kill a sandbox, a revoked key is refused, and envd
calls without the sandbox's access token are refused."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys

import httpx
import pytest
from e2b import (
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxException,
    SandboxQuery,
    ServiceBusyException,
)
from gateway_proc import E2bSetup

from kibotos.testing.waiting import wait_until_sync

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sandbox(e2b: E2bSetup):
    sbx = Sandbox.create("base", metadata={"userId": "u 1", "purpose": "tests"},
                         envs={"GREETING": "hello from envs"}, **e2b.opts())
    try:
        yield sbx
    finally:
        sbx.kill()


def test_create_returns_a_running_sandbox(sandbox: Sandbox, e2b: E2bSetup) -> None:
    info = sandbox.get_info()
    assert info.sandbox_id == sandbox.sandbox_id
    assert info.metadata == {"userId": "u 1", "purpose": "tests"}
    assert info.template_id == "base"
    assert info.state.value == "running"
    assert sandbox.is_running()
    # A get or a list shows no secret: the envd access token is only in create and
    # connect answers.
    for path in (f"/sandboxes/{sandbox.sandbox_id}", "/v2/sandboxes"):
        shown = httpx.get(e2b.gateway.api_url + path, headers={"X-API-Key": e2b.key})
        assert shown.status_code == 200, shown.text
        assert "envdAccessToken" not in shown.text
    ws = e2b.cluster.api("GET", f"/v1/workspaces/ws-{sandbox.sandbox_id}")
    assert ws["state"] == "AVAILABLE"
    assert ws["labels"] == {"e2b.team": "blue"}


def test_commands_run_output_exit_codes_and_envs(sandbox: Sandbox) -> None:
    done = sandbox.commands.run("echo out; echo err >&2; echo $GREETING")
    assert done.exit_code == 0
    assert done.stdout == "out\nhello from envs\n"
    assert done.stderr == "err\n"
    with pytest.raises(CommandExitException) as failed:
        sandbox.commands.run("echo bad >&2; exit 3")
    assert failed.value.exit_code == 3
    assert failed.value.stderr == "bad\n"
    assert sandbox.commands.run("echo $A-$GREETING", envs={"A": "a"}).stdout \
        == "a-hello from envs\n"
    assert sandbox.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    seen: list[str] = []
    sandbox.commands.run("for i in 1 2 3; do echo $i; done", on_stdout=seen.append)
    assert "".join(seen) == "1\n2\n3\n"


def test_background_commands_are_listed_and_killed(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("sleep 600", background=True)
    assert handle.pid in [p.pid for p in sandbox.commands.list()]
    assert sandbox.commands.kill(handle.pid)
    with pytest.raises(CommandExitException):
        handle.wait()
    assert handle.pid not in [p.pid for p in sandbox.commands.list()]


def test_stdin_reaches_the_process(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("head -n 1", background=True, stdin=True)
    sandbox.commands.send_stdin(handle.pid, "typed in\n")
    assert handle.wait().stdout == "typed in\n"


def test_files_write_read_list_and_change(sandbox: Sandbox) -> None:
    sandbox.files.write("/tmp/e2b-test/hello.txt", "hi there")
    assert sandbox.files.read("/tmp/e2b-test/hello.txt") == "hi there"
    blob = os.urandom(8 << 20)
    sandbox.files.write("/tmp/e2b-test/blob.bin", blob)
    back = sandbox.files.read("/tmp/e2b-test/blob.bin", format="bytes")
    assert hashlib.sha256(back).hexdigest() == hashlib.sha256(blob).hexdigest()
    names = sorted(e.name for e in sandbox.files.list("/tmp/e2b-test"))
    assert names == ["blob.bin", "hello.txt"]
    assert sandbox.files.exists("/tmp/e2b-test/hello.txt")
    assert not sandbox.files.exists("/tmp/e2b-test/nothing")
    assert sandbox.files.make_dir("/tmp/e2b-test/sub")
    assert not sandbox.files.make_dir("/tmp/e2b-test/sub")
    moved = sandbox.files.rename("/tmp/e2b-test/hello.txt", "/tmp/e2b-test/sub/moved.txt")
    assert moved.path == "/tmp/e2b-test/sub/moved.txt"
    # (The test VMM's guest serves files under its own root and runs processes on the
    # host, so files and commands are not compared here; the qemu test does.)
    assert sandbox.files.read("/tmp/e2b-test/sub/moved.txt") == "hi there"
    sandbox.files.remove("/tmp/e2b-test")
    assert not sandbox.files.exists("/tmp/e2b-test")


def test_watch_dir_reports_changes_until_stopped(sandbox: Sandbox, e2b: E2bSetup) -> None:
    sandbox.files.make_dir("/tmp/e2b-watch/sub")
    handle = sandbox.files.watch_dir("/tmp/e2b-watch", recursive=True)
    sandbox.files.write("/tmp/e2b-watch/sub/a.txt", "a")
    sandbox.files.rename("/tmp/e2b-watch/sub/a.txt", "/tmp/e2b-watch/b.txt")
    sandbox.files.remove("/tmp/e2b-watch/b.txt")
    seen: list[tuple[str, str]] = []

    def removed() -> bool | None:
        seen.extend((e.name, e.type.value) for e in handle.get_new_events())
        return ("b.txt", "remove") in seen or None

    wait_until_sync(removed, "the remove to be seen")
    # The upload's temporary file is not shown; the file it became is created and written.
    assert seen == [("sub/a.txt", "create"), ("sub/a.txt", "write"),
                    ("sub/a.txt", "rename"), ("b.txt", "create"), ("b.txt", "remove")]
    watcher_id = handle._watcher_id
    handle.stop()
    # The watcher is gone in the gateway too: polling it again is not_found.
    gone = httpx.post(e2b.gateway.sandbox_url + "/filesystem.Filesystem/GetWatcherEvents",
                      json={"watcherId": watcher_id}, headers={
                          "E2b-Sandbox-Id": sandbox.sandbox_id,
                          "X-Access-Token": sandbox._envd_access_token or ""})
    assert (gone.status_code, gone.json()["code"]) == (404, "not_found")
    with pytest.raises(SandboxException):
        sandbox.files.watch_dir("/tmp/e2b-watch/nothing")


def test_the_async_sdk_streams_watch_dir(sandbox: Sandbox, e2b: E2bSetup) -> None:
    async def watch() -> list[tuple[str, str]]:
        sbx = await AsyncSandbox.connect(sandbox.sandbox_id, **e2b.opts())
        seen: list[tuple[str, str]] = []
        await sbx.files.make_dir("/tmp/e2b-awatch")
        handle = await sbx.files.watch_dir(
            "/tmp/e2b-awatch", lambda e: seen.append((e.name, e.type.value)))
        await sbx.files.make_dir("/tmp/e2b-awatch/d")
        for _ in range(600):  # at most a minute: the event arrives on the stream
            if seen:
                break
            await asyncio.sleep(0.1)
        await handle.stop()
        return seen

    seen = asyncio.run(watch())
    assert seen[0] == ("d", "create")  # (then a chmod: make_dir sets its mode exactly)


def test_list_filters_by_metadata_and_pages(sandbox: Sandbox, e2b: E2bSetup) -> None:
    found = Sandbox.list(query=SandboxQuery(metadata={"userId": "u 1"}), **e2b.opts()).next_items()
    assert [s.sandbox_id for s in found] == [sandbox.sandbox_id]
    assert Sandbox.list(query=SandboxQuery(metadata={"userId": "other"}),
                        **e2b.opts()).next_items() == []
    pages = Sandbox.list(limit=1, **e2b.opts())
    assert [s.sandbox_id for s in pages.next_items()] == [sandbox.sandbox_id]


def test_another_team_sees_nothing_and_cannot_act(sandbox: Sandbox, e2b: E2bSetup) -> None:
    red = e2b.opts(e2b.other_key)
    assert Sandbox.list(**red).next_items() == []
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sandbox.sandbox_id, **red)
    with pytest.raises(SandboxException):
        Sandbox.connect(sandbox.sandbox_id, **red)
    assert Sandbox.kill(sandbox.sandbox_id, **red) is False
    assert sandbox.is_running()
    # envd without the sandbox's access token, or with a made-up one: refused.
    for headers in ({}, {"X-Access-Token": "guessed"}):
        r = httpx.post(f"{e2b.gateway.sandbox_url}/filesystem.Filesystem/Stat",
                       json={"path": "/"}, headers={"E2b-Sandbox-Id": sandbox.sandbox_id,
                                                    **headers})
        assert r.status_code == 401, r.text
        assert r.json()["code"] == "unauthenticated"


def test_bad_and_revoked_keys_are_refused(e2b: E2bSetup) -> None:
    with pytest.raises(AuthenticationException):
        Sandbox.list(**e2b.opts("kak-00000000000000000000000000.nope")).next_items()
    key = e2b.cluster.kibo("api-key", "create", "short-lived", "--team", "blue")
    assert key.returncode == 0, key.stderr
    token = key.stdout.strip()
    assert Sandbox.list(**e2b.opts(token)).next_items() is not None
    revoked = e2b.cluster.kibo("api-key", "revoke", token.partition(".")[0])
    assert revoked.returncode == 0, revoked.stderr

    def refused() -> bool:  # within the gateway's key cache lifetime (KEY_TTL)
        try:
            Sandbox.list(**e2b.opts(token)).next_items()
        except AuthenticationException:
            return True
        return False

    wait_until_sync(refused, "the revoked key is refused", timeout=60.0, interval=0.5)


def test_connect_and_kill(e2b: E2bSetup) -> None:
    sbx = Sandbox.create("base", **e2b.opts())
    again = Sandbox.connect(sbx.sandbox_id, **e2b.opts())
    assert again.commands.run("echo connected").stdout == "connected\n"
    assert sbx.kill()
    assert Sandbox.kill(sbx.sandbox_id, **e2b.opts()) is False
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sbx.sandbox_id, **e2b.opts())


def test_unsupported_options_are_refused_by_name(e2b: E2bSetup) -> None:
    with pytest.raises(SandboxException, match="mcp"):
        Sandbox.create("base", mcp={"x": {}}, **e2b.opts())


def test_an_expired_timeout_kills_the_sandbox(e2b: E2bSetup) -> None:
    sbx = Sandbox.create("base", timeout=600, **e2b.opts())
    sbx.set_timeout(1)

    def gone() -> bool:
        try:
            Sandbox.get_info(sbx.sandbox_id, **e2b.opts())
        except NotFoundException:
            return True
        return False

    wait_until_sync(gone, "the sandbox is killed at the end of its timeout", timeout=120.0,
                    interval=0.5)
    state = e2b.cluster.api("GET", f"/v1/workspaces/ws-{sbx.sandbox_id}")["state"]
    assert state in ("DELETING", "DELETED")


def test_an_expired_timeout_pauses_with_on_timeout_pause(e2b: E2bSetup) -> None:
    sbx = Sandbox.create("base", timeout=2, **e2b.opts(),
                         lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}})
    try:
        wait_until_sync(
            lambda: Sandbox.get_info(sbx.sandbox_id, **e2b.opts()).state.value == "paused",
            "the sandbox is paused at the end of its timeout", timeout=120.0, interval=0.5)
        again = Sandbox.connect(sbx.sandbox_id, **e2b.opts())
        assert again.get_info().state.value == "running"
        assert again.commands.run("echo back").stdout == "back\n"
    finally:
        sbx.kill()


def test_metrics_count_both_apis(sandbox: Sandbox, e2b: E2bSetup) -> None:
    sandbox.commands.run("true")
    text = httpx.get(f"{e2b.gateway.api_url}/metrics").text
    start = ('kibotos_gateway_e2b_http_requests_total{api="envd",method="POST",'
             'route="/process.Process/Start",status="200"}')
    create = ('kibotos_gateway_e2b_http_requests_total{api="control",method="POST",'
              'route="/v2/sandboxes",status="201"}')
    assert start in text
    assert create in text
    assert 'kibotos_gateway_e2b_http_body_bytes_total{api="envd",direction="in"}' in text


def test_a_pty_takes_input_and_shows_output(sandbox: Sandbox) -> None:
    seen = bytearray()
    terminal = sandbox.pty.create(PtySize(rows=24, cols=80), timeout=60)
    sandbox.pty.resize(terminal.pid, PtySize(rows=30, cols=100))
    sandbox.pty.send_stdin(terminal.pid, b"stty size; echo pty-$((6*7)); exit 5\n")
    with pytest.raises(CommandExitException) as ended:
        terminal.wait(on_pty=seen.extend)
    assert ended.value.exit_code == 5
    assert b"30 100" in seen
    assert b"pty-42" in seen


def test_the_clusters_e2b_env_is_all_an_sdk_script_needs(e2b: E2bSetup) -> None:
    env_file = e2b.gateway.env_file
    assert env_file.stat().st_mode & 0o777 == 0o600
    settings = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
    assert set(settings) == {"E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN",
                             "KIBOTOS_EXPOSURE_URL"}
    script = ("from e2b import Sandbox\n"
              "s = Sandbox.create()\n"
              "print(s.commands.run('echo from a script').stdout, end='')\n"
              "s.kill()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    done = subprocess.run([sys.executable, "-c", script], env={**env, **settings},
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "from a script\n"
    status = {p.name: p for p in e2b.cluster.status()}
    assert status["e2b-gateway"].pid is not None
    assert status["exposure-gateway"].pid is not None


def test_network_options_become_the_workspace_policy(e2b: E2bSetup) -> None:
    """allow_internet_access and allow_out / deny_out are ctrl's network policy; this
    cluster's node has no [network], so ctrl refuses to place it, and the caller gets
    ctrl's reason instead of a sandbox without the policy."""
    with pytest.raises(ServiceBusyException, match="no network on the node") as refused:
        Sandbox.create("base", allow_internet_access=False,
                       network={"allow_out": ["198.18.0.1/32"]}, **e2b.opts())
    assert str(refused.value).startswith("503: ")
    listed = e2b.cluster.api("GET", "/v1/workspaces", params={"label": "e2b.team=blue"})
    assert all(ws["network"]["policy"] is None or ws["state"] in ("DELETING", "DELETED")
               for ws in listed["workspaces"])


def test_dns_servers_are_checked_and_shown(e2b: E2bSetup) -> None:
    """``dns_servers``: at most 10 IPv4 addresses, at create and in ``update_network``;
    E2B applies them only beside a domain in ``allow_out``, which kibotos refuses, so
    they open nothing (and alone ask for no policy: this node, with no [network],
    places the sandbox)."""
    sbx = Sandbox.create("base", network={"dns_servers": ["1.1.1.1", "9.9.9.9"],
                                          "allow_public_traffic": False}, **e2b.opts())
    try:
        assert sbx.get_info().network == {"dns_servers": ["1.1.1.1", "9.9.9.9"],
                                          "allow_public_traffic": False}
        ws = e2b.cluster.api("GET", f"/v1/workspaces/ws-{sbx.sandbox_id}")
        assert ws["network"]["policy"] is None
        headers = {"X-API-Key": e2b.key}
        for bad, why in ((["::1"], "'::1' is not an IPv4 address"),
                         (["1.1.1.1 "], "is not an IPv4 address"),
                         (["١.١.١.١"], "is not an IPv4 address"),
                         ([f"10.0.0.{i}" for i in range(11)], "at most 10"),
                         ([1], "valid string")):
            for method, path, body in (
                    ("POST", "/v2/sandboxes", {"templateID": "base",
                                               "network": {"dnsServers": bad}}),
                    ("PUT", f"/sandboxes/{sbx.sandbox_id}/network", {"dnsServers": bad})):
                answer = httpx.request(method, e2b.gateway.api_url + path, json=body,
                                       headers=headers, timeout=60)
                assert answer.status_code == 400, answer.text
                assert why in answer.json()["message"], answer.text
                assert "dnsServers" in answer.json()["message"]
    finally:
        sbx.kill()


def _egresses(e2b: E2bSetup) -> list[str]:
    return [e["name"] for e in e2b.cluster.api("GET", "/v1/egresses")["egresses"]]


def test_an_egress_proxy_is_an_egress_of_its_own_that_goes_with_its_sandbox(
        sandbox: Sandbox, e2b: E2bSetup) -> None:
    """``egress_proxy`` becomes an Egress in ctrl (its password sealed there); when ctrl
    cannot place or switch the Workspace (this node has no [network]) the Egress is
    deleted again, and a bad address is refused naming the option.  The proxy's traffic
    itself: test_e2b_sdk_qemu.py."""
    proxy = {"address": "198.18.1.2:1080", "username": "alice", "password": "s3cret"}
    before = _egresses(e2b)
    with pytest.raises(ServiceBusyException, match="no network on the node"):
        Sandbox.create("base", network={"egress_proxy": proxy}, **e2b.opts())
    with pytest.raises(SandboxException,
                       match=r"409: .*cannot enforce this policy \(no network on the node"):
        sandbox.update_network({"egress_proxy": proxy})
    with pytest.raises(SandboxException, match=r"400: network\.egressProxy: .*no port"):
        Sandbox.create("base", network={"egress_proxy": {"address": "nowhere"}},
                       **e2b.opts())
    too_long = "pw" * 200  # refused by ctrl, which never repeats a password
    with pytest.raises(SandboxException, match=r"400: network\.egressProxy: .*password") \
            as refused:
        Sandbox.create("base", network={"egress_proxy": {**proxy, "password": too_long}},
                       **e2b.opts())
    assert "pwpwpw" not in str(refused.value)
    with pytest.raises(SandboxException, match=r"400: .*network\.egressProxy\.tls"):
        sandbox.update_network({"egress_proxy": {**proxy, "tls": True}})
    assert _egresses(e2b) == before


def test_envd_is_also_routed_by_host_name(sandbox: Sandbox, e2b: E2bSetup) -> None:
    """``49983-<sandbox>.<domain>``, what the SDK uses without E2B_SANDBOX_URL."""
    connected = httpx.post(f"{e2b.gateway.api_url}/v2/sandboxes/{sandbox.sandbox_id}/connect",
                           json={"timeout": 600}, headers={"X-API-Key": e2b.key})
    assert connected.status_code == 200, connected.text
    token = connected.json()["envdAccessToken"]
    stat = httpx.post(f"{e2b.gateway.sandbox_url}/filesystem.Filesystem/Stat",
                      json={"path": "/"}, headers={
                          "Host": f"49983-{sandbox.sandbox_id}.sandbox.example",
                          "X-Access-Token": token})
    assert stat.status_code == 200, stat.text
    assert stat.json()["entry"]["type"] == "FILE_TYPE_DIRECTORY"
    other_port = httpx.post(f"{e2b.gateway.sandbox_url}/filesystem.Filesystem/Stat",
                            json={"path": "/"}, headers={
                                "Host": f"8080-{sandbox.sandbox_id}.sandbox.example",
                                "X-Access-Token": token})
    assert other_port.status_code == 404
