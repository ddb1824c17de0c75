"""The ``direct`` supervisor's ``kill_grace`` option: how long `stop` waits after SIGKILL
before it names the processes stuck in the kernel (tests/node/test_instance_cleanup_pending.py
has a real one)."""

from __future__ import annotations

from pathlib import Path

import pytest
from kibotos_direct.supervisor import DirectSupervisor

from kibotos.core.errors import InvalidArgument


def test_kill_grace_defaults_to_a_minute_and_accepts_seconds(tmp_path: Path) -> None:
    assert DirectSupervisor({"state_dir": str(tmp_path)}).kill_grace == 60.0
    assert DirectSupervisor({"state_dir": str(tmp_path), "kill_grace": 0.5}).kill_grace == 0.5


@pytest.mark.parametrize("value", ["soon", 0, -1, 7200])
def test_a_bad_kill_grace_is_refused(tmp_path: Path, value: object) -> None:
    with pytest.raises(InvalidArgument, match="kill_grace"):
        DirectSupervisor({"state_dir": str(tmp_path), "kill_grace": value})
