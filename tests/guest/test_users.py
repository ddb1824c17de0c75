"""The ``user`` field (a user name) on exec and file writes, against the real agent
process: the process runs with that user's uid, groups, HOME and home directory; what
a write, mkdir or tar upload creates (parents included) is owned by the user; an
unknown or malformed name is ``invalid_argument`` naming it.

The names are the host's passwd entries (the agent reads ``/etc/passwd`` of the system
it runs on): ``nobody`` everywhere, and for the home directory any non-root user whose
home exists."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pwd
import tarfile

import pytest
import trio
from guest_harness import AgentProcess

from kibotos.core.errors import InvalidArgument
from kibotos.guest import GuestChannel
from kibotos.guest.kibotos_guest import CAPABILITIES

pytestmark = pytest.mark.root
NOBODY = pwd.getpwnam("nobody")
NOBODY_CWD = NOBODY.pw_dir if os.path.isdir(NOBODY.pw_dir) else "/"


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _user_with_home() -> pwd.struct_passwd | None:
    return next((p for p in sorted(pwd.getpwall(), key=lambda p: p.pw_uid)
                 if p.pw_uid != 0 and os.path.isdir(p.pw_dir) and p.pw_dir != "/"), None)


USER_WITH_HOME = _user_with_home()
HOME_REAL = os.path.realpath(USER_WITH_HOME.pw_dir) if USER_WITH_HOME else ""


async def test_the_agent_announces_user_names(guest: GuestChannel) -> None:
    assert "user_names" in CAPABILITIES
    assert guest.hello is not None
    assert "user_names" in guest.hello.capabilities


async def test_exec_as_a_user_has_its_ids_groups_and_login_variables(
        guest: GuestChannel) -> None:
    status, out, err = await guest.run(
        ["sh", "-c", 'id -u; id -g; id -G; echo "$HOME|$USER|$LOGNAME"; pwd'],
        user="nobody")
    assert status.exit_code == 0, err
    uid, gid, groups, login, cwd = out.decode().split("\n")[:5]
    assert (int(uid), int(gid)) == (NOBODY.pw_uid, NOBODY.pw_gid)
    assert sorted(int(g) for g in groups.split()) == sorted(
        set(os.getgrouplist("nobody", NOBODY.pw_gid)))
    assert login == f"{NOBODY.pw_dir}|nobody|nobody"
    # nobody's home does not exist: the process starts in /, as envd's would.
    assert cwd == NOBODY_CWD


async def test_exec_as_a_user_starts_in_its_home_unless_told(guest: GuestChannel) -> None:
    user = USER_WITH_HOME
    if user is None:
        pytest.skip("no non-root user with a home directory on this host")
    status, out, _ = await guest.run(["sh", "-c", "pwd; id -un"], user=user.pw_name)
    assert out.decode().split("\n")[:2] == [HOME_REAL, user.pw_name]
    status, out, _ = await guest.run(["pwd"], user=user.pw_name, cwd="/tmp")
    assert (status.exit_code, out) == (0, b"/tmp\n")


async def test_files_written_as_a_user_are_owned_by_it(
        guest: GuestChannel, agent: AgentProcess) -> None:
    files, owner = guest.files, (NOBODY.pw_uid, NOBODY.pw_gid)
    (agent.root / "work").mkdir()
    data = b"hello"
    async with await files.open_write("/work/a/b/f.txt", parents=True,
                                      user="nobody") as up:
        await up.stream.send_all(data)
        done = await up.commit(_sha(data))
    assert done.entry is not None
    assert (done.entry.uid, done.entry.owner) == (NOBODY.pw_uid, "nobody")
    for rel in ("a", "a/b", "a/b/f.txt"):
        st = (agent.root / "work" / rel).stat()
        assert (st.st_uid, st.st_gid) == owner, rel
    assert (agent.root / "work").stat().st_uid == 0  # existed before: left alone

    entry, created = await files.mkdir("/work/m/n", user="nobody")
    assert created
    assert entry.uid == NOBODY.pw_uid
    assert (agent.root / "work/m").stat().st_uid == NOBODY.pw_uid

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in ("tree", "tree/sub"):
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.uid = tarfile.DIRTYPE, 0o755, 1234
            tar.addfile(info)
        info = tarfile.TarInfo("tree/sub/x")
        info.size, info.uid, info.gid = 3, 1234, 5678
        tar.addfile(info, io.BytesIO(b"xyz"))
    archive = buf.getvalue()
    async with await files.open_tar_write("/work", user="nobody") as up:
        with contextlib.suppress(trio.BrokenResourceError):
            await up.stream.send_all(archive)
        await up.commit(_sha(archive))
    for rel in ("tree", "tree/sub", "tree/sub/x"):
        st = (agent.root / "work" / rel).stat()
        assert (st.st_uid, st.st_gid) == owner, rel
    assert (agent.root / "work").stat().st_uid == 0  # merged into, not created


async def test_an_unknown_user_is_invalid_argument_naming_it(guest: GuestChannel) -> None:
    with pytest.raises(InvalidArgument, match="no user named 'no-such-user'"):
        await guest.run(["true"], user="no-such-user")
    with pytest.raises(InvalidArgument, match="no user named 'no-such-user'"):
        await guest.files.mkdir("/m", user="no-such-user")
    with pytest.raises(InvalidArgument, match="no user named 'no-such-user'"):
        await guest.files.open_write("/f", user="no-such-user")


@pytest.mark.parametrize("name", ["", "a" * 33, "bad\nname", "a:b", "a/b", "nul\0"])
async def test_a_malformed_user_name_is_refused(guest: GuestChannel, name: str) -> None:
    with pytest.raises(InvalidArgument, match="field 'user'"):
        await guest.run(["true"], user=name)


async def test_a_user_and_a_uid_together_are_refused(guest: GuestChannel) -> None:
    with pytest.raises(InvalidArgument, match="'user' or 'uid'/'gid', not both"):
        await guest.run(["true"], user="nobody", uid=0)
