"""`kibotos.core.failpoints.environment_for`: the entries a node passes on to the units it
starts (which do not inherit its environment), read when it starts one."""

from __future__ import annotations

import pytest

from kibotos.core import failpoints


def test_only_the_prefix_s_entries_pass_on_read_at_the_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(failpoints.ENV, raising=False)
    assert failpoints.environment_for("dataplane.") == {}
    monkeypatch.setenv(failpoints.ENV, "node.incarnation.after-write=kill, "
                       "dataplane.handover.after-receive=kill@2,dataplane.serve.after-control")
    assert failpoints.environment_for("dataplane.") == {
        failpoints.ENV: "dataplane.handover.after-receive=kill@2,"
                        "dataplane.serve.after-control=error"}
    assert failpoints.environment_for("egress.") == {}
