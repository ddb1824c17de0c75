"""A guest user name (``user``) through a data plane (in this process) to the real
guest agent: exec runs as the user, uploads and mkdirs are owned by it, a malformed
name is refused by the data plane before the guest sees it, and an agent that does not
announce ``user_names`` (a copy of the real agent announcing what 0.5.2 did) refuses
any user but root with a failed_precondition naming the version needed."""

from __future__ import annotations

import hashlib
import pwd
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import dp_harness
import httpx
import pytest
from dp_harness import TIMEOUT, in_process_plane, run_exec, running_agent, target

from kibotos.core.errors import FailedPrecondition, InvalidArgument
from kibotos.dataplane.clients.files_client import FilesClient
from kibotos.guest import AGENT_PATH

pytestmark = pytest.mark.root
NOBODY = pwd.getpwnam("nobody")


async def _one(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def test_exec_and_writes_as_a_user(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            result = await run_exec(plane, ["sh", "-c", 'id -un; id -u; echo "$HOME"'],
                                    user="nobody")
            assert result.stdout.decode().split("\n")[:3] == [
                "nobody", str(NOBODY.pw_uid), NOBODY.pw_dir]
            assert (await run_exec(plane, ["id", "-un"], user="root")).stdout == b"root\n"
            assert (await run_exec(plane, ["id", "-un"])).stdout == b"root\n"  # the default

            files = FilesClient(plane.url, plane.credential(operations=("files",)))
            answer = await files.upload("content", "/w/x/f", _one(b"data"), parents="true",
                                        user="nobody")
            assert answer["entry"]["owner"] == "nobody"
            for rel in ("w", "w/x", "w/x/f"):
                assert (agent.root / rel).stat().st_uid == NOBODY.pw_uid, rel
            entry, created = await files.mkdir("/d/e", user="nobody")
            assert created
            assert (entry.uid, (agent.root / "d").stat().st_uid) == (NOBODY.pw_uid,) * 2

            with pytest.raises(InvalidArgument, match="no user named 'no-such-user'"):
                await run_exec(plane, ["true"], user="no-such-user")
            with pytest.raises(InvalidArgument, match="exec: user must not contain"):
                await run_exec(plane, ["true"], user="a:b")
            with pytest.raises(InvalidArgument, match="user must be 1 to 32 characters"):
                await files.mkdir("/d/f", user="u" * 33)
            # The data plane's own check, not only the client's.
            async with httpx.AsyncClient(base_url=plane.url, timeout=TIMEOUT) as http:
                resp = await http.put(
                    "/v1/files/content", params={"path": "/g", "user": "bad\nname"},
                    content=b"x", headers={
                        "Authorization": f"Bearer {plane.credential(operations=('files',))}",
                        "Kibotos-Sha256": "sha256:" + hashlib.sha256(b"x").hexdigest()})
            assert resp.status_code == 400
            assert "control characters" in resp.json()["error"]["message"]
            assert not (agent.root / "g").exists()


def _old_agent(tmp_path: Path) -> Path:
    """The real agent, copied, announcing what agent 0.5.2 did (no ``user_names``)."""
    source = Path(AGENT_PATH).parent
    copy = tmp_path / "old-agent"
    shutil.copytree(source / "kibotos_guest", copy / "kibotos_guest",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(AGENT_PATH, copy / "agent.py")
    init = copy / "kibotos_guest" / "__init__.py"
    text = init.read_text()
    for old, new in (('AGENT_VERSION = "0.6.0"', 'AGENT_VERSION = "0.5.2"'),
                     (' "user_names",', "")):
        assert old in text
        text = text.replace(old, new)
    init.write_text(text)
    return copy / "agent.py"


async def test_an_older_agent_refuses_a_user_but_root(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dp_harness, "AGENT_PATH", _old_agent(tmp_path))
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            with pytest.raises(FailedPrecondition, match=r"needs guest agent 0\.6\.0 or later "
                                                         r"\(this guest has 0\.5\.2\)"):
                await run_exec(plane, ["id", "-un"], user="nobody")
            assert (await run_exec(plane, ["id", "-un"], user="root")).stdout == b"root\n"
            files = FilesClient(plane.url, plane.credential(operations=("files",)))
            with pytest.raises(FailedPrecondition, match=r"0\.6\.0"):
                await files.upload("content", "/f", _one(b"x"), user="nobody")
            assert not (agent.root / "f").exists()


async def test_kibo_exec_and_cp_take_a_user(tmp_path: Path) -> None:
    """``kibo workspace exec --user``'s relay (as a process, as kibo runs it) and ``kibo
    workspace cp --user``'s copy; a copy out with a user, or a bad name, is refused."""
    from test_exec_blocking import relay

    from kibotos.cli.workspace.cp_cmds import Remote, copy

    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path) as plane:
            await plane.hand_state(target(agent))
            done = await relay(plane, ["sh", "-c", "id -un; pwd"], user="nobody")
            assert (done.returncode, done.stdout.decode().split("\n")[0]) == (0, "nobody")
            done = await relay(plane, ["true"], user="a:b")
            assert done.returncode == 10
            assert b"must not contain control characters, ':' or '/'" in done.stderr

            local = tmp_path / "site"
            (local / "css").mkdir(parents=True)
            (local / "css" / "a.css").write_bytes(b"body{}")
            (local / "index.html").write_bytes(b"<p>")
            (agent.root / "srv").mkdir()
            credential = plane.credential(operations=("files",))
            await copy(plane.url, credential, str(local), Remote("ws-1", "/srv"),
                       user="nobody")
            await copy(plane.url, credential, str(local / "index.html"),
                       Remote("ws-1", "/srv/one.html"), user="nobody")
            for rel in ("site", "site/css", "site/css/a.css", "site/index.html", "one.html"):
                assert (agent.root / "srv" / rel).stat().st_uid == NOBODY.pw_uid, rel
            assert (agent.root / "srv").stat().st_uid == 0
            with pytest.raises(InvalidArgument, match="--user applies to a copy into"):
                await copy(plane.url, credential, Remote("ws-1", "/srv/one.html"),
                           str(tmp_path / "back.html"), user="nobody")


def test_the_cli_checks_the_name_before_asking_ctrl() -> None:
    from click.testing import CliRunner

    from kibotos.cli.main import kibo_cli

    for argv in (["workspace", "exec", "--user", "a" * 33, "ws-1", "--", "true"],
                 ["workspace", "cp", "--user", "bad\tname", "./x", "ws-1:/x"]):
        result = CliRunner().invoke(kibo_cli, argv, env={"KIBO_CONFIG": "/nonexistent"})
        assert result.exit_code == 10, (argv, result.output)
        assert "--user must" in result.output
