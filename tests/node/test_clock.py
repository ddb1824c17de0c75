"""The reported clock: wall time plus the test skew file, and the kernel's sync status."""

from __future__ import annotations

import ctypes
from pathlib import Path

from kibotos.node.host.clock import (
    SYNCHRONIZED,
    UNKNOWN,
    UNSYNCHRONIZED,
    NodeClock,
    _Timex,
    kernel_sync_status,
    read_skew,
)


def test_no_skew_file_means_no_skew(tmp_path: Path) -> None:
    assert read_skew(None) == 0.0
    assert read_skew(tmp_path / "absent") == 0.0
    (tmp_path / "empty").write_text("\n")
    assert read_skew(tmp_path / "empty") == 0.0


def test_skew_is_reread_at_every_probe(tmp_path: Path) -> None:
    skew = tmp_path / "skew"
    clock = NodeClock(skew, wall=lambda: 1000.0, sync_status=lambda: SYNCHRONIZED)
    assert clock.now() == 1000.0
    skew.write_text("45.5\n")
    assert clock.now() == 1045.5
    skew.write_text("-31")
    assert clock.now() == 969.0
    skew.unlink()
    assert clock.now() == 1000.0


def test_malformed_skew_counts_as_zero(tmp_path: Path, caplog) -> None:
    skew = tmp_path / "skew"
    for text in ("soon", "nan", "inf"):
        skew.write_text(text)
        assert read_skew(skew) == 0.0
    assert "clock skew file malformed" in caplog.text
    skew.unlink()
    skew.mkdir()
    assert read_skew(skew) == 0.0
    assert "clock skew file unreadable" in caplog.text


def test_reply_frame(tmp_path: Path) -> None:
    (tmp_path / "skew").write_text("2")
    clock = NodeClock(tmp_path / "skew", wall=lambda: 50.0, sync_status=lambda: UNKNOWN)
    assert clock.reply(7).to_wire() == {"type": "clock_reply", "id": 7, "node_time": 52.0,
                                        "sync_status": "unknown"}


def test_kernel_sync_status_is_one_of_three() -> None:
    assert ctypes.sizeof(_Timex) == (208 if ctypes.sizeof(ctypes.c_long) == 8 else 128)
    assert kernel_sync_status() in (SYNCHRONIZED, UNSYNCHRONIZED, UNKNOWN)
