"""Egress credentials on the node: the client against ctrl's endpoint (a fake of its
shape on loopback, `kibotos.testing.fake_credentials`), and the files: one per revision,
directory 0700 and files 0600 of root, gone as soon as nothing references them, and
enough on their own after a restart."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kibotos.core.errors import FailedPrecondition, InvalidArgument, NotFound, Unauthenticated
from kibotos.node.egress.credentials import CredentialClient, CredentialStore
from kibotos.testing.fake_credentials import FakeCredentials

REVISIONS = {("corp", 1): ("alice", "s3cret"), ("corp", 2): ("alice", "n3w"),
             ("open", 1): (None, None)}


@pytest.fixture
def ctrl():
    with FakeCredentials("node-secret", REVISIONS) as fake:
        yield fake


async def test_the_client_fetches_one_revision_with_the_node_identity(ctrl):
    client = CredentialClient(ctrl.url, "node-secret")
    credential = await client.fetch("corp", 2)
    assert (credential.name, credential.revision, credential.username,
            credential.password) == ("corp", 2, "alice", "n3w")
    assert "n3w" not in repr(credential)
    assert ctrl.requests == [("corp", 2)]
    assert (await client.fetch("open", 1)).username is None
    with pytest.raises(NotFound, match="egress corp has no revision 9"):
        await client.fetch("corp", 9)
    with pytest.raises(Unauthenticated, match="a node credential is required"):
        await CredentialClient(ctrl.url, "wrong").fetch("corp", 1)


@pytest.mark.parametrize(("answer", "message"), [
    ({"name": "corp", "revision": 2, "username": "alice", "password": "x"},
     "are for 'corp' revision 2, not corp revision 1"),
    ({"name": "corp", "revision": 1, "username": "alice"}, "expected name, revision"),
    ({"name": "corp", "revision": 1, "username": "alice", "password": None},
     "a username needs a password"),
    ({"name": "corp", "revision": 1, "username": "a", "password": "x" * 300},
     "the password from ctrl must be a string of 1-255 bytes"),
    (["not", "an", "object"], "not a JSON object"),
])
async def test_a_malformed_answer_is_refused_without_its_secret(ctrl, answer, message):
    ctrl.answer_override = answer
    with pytest.raises(InvalidArgument, match=message) as caught:
        await CredentialClient(ctrl.url, "node-secret").fetch("corp", 1)
    assert "x" * 300 not in caught.value.message


def test_secrets_are_never_fetched_in_clear_text_off_loopback():
    with pytest.raises(InvalidArgument, match="must be https:"):
        CredentialClient("http://ctrl.example:8080", "node-secret")
    CredentialClient("https://ctrl.example:8443", "node-secret")
    CredentialClient("http://[::1]:8080", "node-secret")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


async def test_files_have_the_modes_and_vanish_when_unreferenced(ctrl, tmp_path):
    store = CredentialStore(tmp_path / "state", CredentialClient(ctrl.url, "node-secret"))
    first = await store.ensure("corp", 1)
    await store.ensure("corp", 2)
    assert first.password == "s3cret"
    assert mode(store.directory) == 0o700
    for key in (("corp", 1), ("corp", 2)):
        path = store.path(*key)
        assert mode(path) == 0o600
        assert os.stat(path).st_uid == os.geteuid()
    assert store.stored() == [("corp", 1), ("corp", 2)]
    assert len(ctrl.requests) == 2
    # a file there is used as it is: ctrl is not asked again
    assert (await store.ensure("corp", 1)).password == "s3cret"
    assert len(ctrl.requests) == 2
    assert store.retain_only([("corp", 2)]) == [("corp", 1)]
    assert sorted(os.listdir(store.directory)) == ["corp@2.json"]
    # a restarted node without ctrl restores from the file alone
    offline = CredentialStore(tmp_path / "state", None)
    assert (await offline.ensure("corp", 2)).password == "n3w"
    with pytest.raises(FailedPrecondition, match="no credentials of egress corp revision 1"):
        await offline.ensure("corp", 1)
    assert store.retain_only([]) == [("corp", 2)]
    assert os.listdir(store.directory) == []


async def test_a_damaged_file_is_fetched_again(ctrl, tmp_path):
    store = CredentialStore(tmp_path / "state", CredentialClient(ctrl.url, "node-secret"))
    await store.ensure("corp", 1)
    store.path("corp", 1).write_text('{"name": "corp"}')
    assert store.load("corp", 1) is None
    assert (await store.ensure("corp", 1)).password == "s3cret"
    assert len(ctrl.requests) == 2
