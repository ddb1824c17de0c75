"""`kibotos.core.failpoints`: an action with ``@N`` runs only at the N-th hit of its name."""

from __future__ import annotations

import pytest

from kibotos.core import failpoints


@pytest.fixture
def table(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    def set_table(spec: str) -> None:
        monkeypatch.setenv(failpoints.ENV, spec)
        failpoints.reload()

    yield set_table
    monkeypatch.delenv(failpoints.ENV, raising=False)
    failpoints.reload()


def test_nth_hit_only(table) -> None:  # type: ignore[no-untyped-def]
    table("atomic.before-rename=error@3, atomic.before-fsync=error")
    failpoints.hit("atomic.before-rename")
    failpoints.hit("atomic.before-rename")
    with pytest.raises(failpoints.FailpointError, match=r"atomic\.before-rename"):
        failpoints.hit("atomic.before-rename")
    failpoints.hit("atomic.before-rename")  # only the third
    with pytest.raises(failpoints.FailpointError):
        failpoints.hit("atomic.before-fsync")  # without @N: every hit
    with pytest.raises(failpoints.FailpointError):
        failpoints.hit("atomic.before-fsync")


def test_reload_resets_the_count(table) -> None:  # type: ignore[no-untyped-def]
    table("atomic.after-rename=error@1")
    with pytest.raises(failpoints.FailpointError):
        failpoints.hit("atomic.after-rename")
    table("atomic.after-rename=error@1")
    with pytest.raises(failpoints.FailpointError):
        failpoints.hit("atomic.after-rename")


def test_every_point_of_the_node_objects_is_known() -> None:
    """The failpoints the pool-object code passes are all listed (docs name them)."""
    import re
    from pathlib import Path

    import kibotos.node.storage.holder_watch as holder_watch
    import kibotos.node.storage.objects as objects

    used = set()
    for module in (objects, holder_watch):
        used |= set(re.findall(r'failpoints\.hit\("([^"]+)"\)',
                               Path(str(module.__file__)).read_text()))
    assert {"objects.take.after-holder", "objects.fence.before-receipt"} <= used
    assert used - set(failpoints.KNOWN) == set()
