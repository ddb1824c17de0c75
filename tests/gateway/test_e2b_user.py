"""envd's user selection through the official E2B SDK (unchanged) against the gateway
and a dev cluster whose test VMM runs the real guest agent (as root, on the host: the
host's users are the guest's): ``commands.run(..., user=)`` (the SDK's ``Authorization:
Basic``) runs as that user, in its home; ``files.write(..., user=)`` (``username`` on
REST ``/files``) and ``make_dir(..., user=)`` create as it; without a user, what the
SDK sends for an envd of 0.4.0 or later (nothing), the agent's user, root; an unknown
user is refused by name."""

from __future__ import annotations

import os
import pwd

import pytest
from e2b import InvalidArgumentException, Sandbox, SandboxException
from gateway_proc import E2bSetup

pytestmark = [pytest.mark.slow, pytest.mark.root]
NOBODY = pwd.getpwnam("nobody")
NOBODY_CWD = NOBODY.pw_dir if os.path.isdir(NOBODY.pw_dir) else "/"


@pytest.fixture(scope="module")
def sandbox(e2b: E2bSetup):
    sbx = Sandbox.create("base", **e2b.opts())
    try:
        yield sbx
    finally:
        sbx.kill()


def test_commands_run_as_the_user_asked(sandbox: Sandbox) -> None:
    assert sandbox.commands.run("id -un", user="root").stdout == "root\n"
    assert sandbox.commands.run("id -un").stdout == "root\n"  # no user sent: the default
    done = sandbox.commands.run('id -un; id -u; echo "$HOME"; pwd', user="nobody")
    # Its home (HOME) as the working directory, or / where that does not exist (envd's).
    assert done.stdout.split("\n")[:4] == ["nobody", str(NOBODY.pw_uid), NOBODY.pw_dir,
                                           NOBODY_CWD]
    assert sandbox.commands.run("pwd", user="nobody", cwd="/tmp").stdout == "/tmp\n"
    handle = sandbox.commands.run("id -un", user="nobody", background=True)
    assert handle.wait().stdout == "nobody\n"


def test_files_are_written_as_the_user_asked(sandbox: Sandbox) -> None:
    sandbox.files.write("/tmp/e2b-user/a/owned.txt", "mine", user="nobody")
    info = sandbox.files.get_info("/tmp/e2b-user/a/owned.txt")
    assert info.owner == "nobody"
    assert sandbox.files.get_info("/tmp/e2b-user/a").owner == "nobody"  # a parent it made
    sandbox.files.write("/tmp/e2b-user/root.txt", "root's", user="root")
    assert sandbox.files.get_info("/tmp/e2b-user/root.txt").owner == "root"
    assert sandbox.files.make_dir("/tmp/e2b-user/d/e", user="nobody")
    assert sandbox.files.get_info("/tmp/e2b-user/d").owner == "nobody"
    sandbox.files.write("/tmp/e2b-user/plain.txt", "default")
    assert sandbox.files.get_info("/tmp/e2b-user/plain.txt").owner == "root"
    sandbox.files.remove("/tmp/e2b-user")


def test_an_unknown_user_is_refused_by_name(sandbox: Sandbox) -> None:
    with pytest.raises(SandboxException, match="no user named 'no-such-user'"):
        sandbox.commands.run("true", user="no-such-user")
    with pytest.raises(InvalidArgumentException, match="no user named 'no-such-user'"):
        sandbox.files.write("/tmp/never.txt", "x", user="no-such-user")
    with pytest.raises(SandboxException, match="no user named 'no-such-user'"):
        sandbox.files.make_dir("/tmp/never", user="no-such-user")
    assert not sandbox.files.exists("/tmp/never.txt")


def test_the_authorization_header_is_read_strictly() -> None:
    """envd's user header: Basic base64("<user>:"), nothing else."""
    import base64

    from starlette.requests import Request

    from kibotos.core.errors import InvalidArgument
    from kibotos.gateway.e2b.envd_api import basic_user

    def user_of(header: str | None) -> str | None:
        headers = [] if header is None else [(b"authorization", header.encode())]
        return basic_user(Request({"type": "http", "headers": headers}))

    def basic(text: bytes) -> str:
        return "Basic " + base64.b64encode(text).decode()

    assert user_of(None) is None
    assert user_of(basic(b"user:")) == "user"
    assert user_of(basic(b"root:ignored")) == "root"
    for bad, why in ((basic(b"user"), "Basic base64"), ("Bearer abc", "Basic base64"),
                     ("Basic !!!", "Basic base64"), (basic(b":"), "1 to 32 characters"),
                     (basic(b"a\nb:"), "control characters"),
                     (basic(b"\xff:"), "Basic base64")):
        with pytest.raises(InvalidArgument, match=why):
            user_of(bad)
