"""The wall clock the node shows ctrl, and the kernel's view of its synchronisation.

ctrl measures the offset of this clock at session start and at every reconciliation and
keeps new Workspaces off a node more than 30 s off (spec/nodes.txt, "list and get").
Tests cannot move the host clock, so ``testing.clock_skew_file`` (docs/dev.md) holds a
number of seconds added to the reported time; it is re-read at every probe so a test
can skew a running node and put it right again.  Production configs leave it unset.

The synchronisation status comes from ``adjtimex(2)`` with ``modes = 0`` (read only, no
privilege needed): ``TIME_ERROR`` or the ``STA_UNSYNC`` flag means the kernel does not
consider its clock synchronised (no NTP daemon disciplining it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable
from pathlib import Path

from kibotos.core.logs import EventLogger
from kibotos.protocol import ClockReply, SyncStatus

log = EventLogger()

SYNCHRONIZED = SyncStatus.SYNCHRONIZED.value
UNSYNCHRONIZED = SyncStatus.UNSYNCHRONIZED.value
UNKNOWN = SyncStatus.UNKNOWN.value

_TIME_ERROR = 5
_STA_UNSYNC = 0x0040


class _Timeval(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_usec", ctypes.c_long)]


class _Timex(ctypes.Structure):
    """``struct timex`` of <sys/timex.h> (Linux, LP64 and ILP32 alike: longs and ints)."""

    _fields_ = [
        ("modes", ctypes.c_uint),
        ("offset", ctypes.c_long),
        ("freq", ctypes.c_long),
        ("maxerror", ctypes.c_long),
        ("esterror", ctypes.c_long),
        ("status", ctypes.c_int),
        ("constant", ctypes.c_long),
        ("precision", ctypes.c_long),
        ("tolerance", ctypes.c_long),
        ("time", _Timeval),
        ("tick", ctypes.c_long),
        ("ppsfreq", ctypes.c_long),
        ("jitter", ctypes.c_long),
        ("shift", ctypes.c_int),
        ("stabil", ctypes.c_long),
        ("jitcnt", ctypes.c_long),
        ("calcnt", ctypes.c_long),
        ("errcnt", ctypes.c_long),
        ("stbcnt", ctypes.c_long),
        ("tai", ctypes.c_int),
        ("_reserved", ctypes.c_int * 11),
    ]


def kernel_sync_status() -> str:
    """``synchronized``, ``unsynchronized``, or ``unknown`` when adjtimex is unavailable
    (no libc symbol, or a seccomp filter refusing the call)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        adjtimex = libc.adjtimex
    except (OSError, AttributeError):
        return UNKNOWN
    adjtimex.argtypes = [ctypes.POINTER(_Timex)]
    adjtimex.restype = ctypes.c_int
    tx = _Timex()
    state = adjtimex(ctypes.byref(tx))
    if state < 0:
        return UNKNOWN
    if state == _TIME_ERROR or tx.status & _STA_UNSYNC:
        return UNSYNCHRONIZED
    return SYNCHRONIZED


def read_skew(path: Path | None) -> float:
    """Seconds to add to the reported time: 0 without a file, or when it is absent or
    empty; an unreadable or malformed file is logged and counts as 0 (there is no caller
    at probe time to hand an error to, and a wrong skew must not end the session)."""
    if path is None:
        return 0.0
    try:
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return 0.0
    except (OSError, UnicodeDecodeError) as exc:
        log.warning("clock skew file unreadable, using 0", path=path, error=str(exc))
        return 0.0
    if not text:
        return 0.0
    try:
        skew = float(text)
    except ValueError:
        log.warning("clock skew file malformed, using 0", path=path, content=text[:40])
        return 0.0
    if skew != skew or skew in (float("inf"), float("-inf")):
        log.warning("clock skew file malformed, using 0", path=path, content=text[:40])
        return 0.0
    return skew


class NodeClock:
    """What the node answers to ``clock_probe``."""

    def __init__(self, skew_file: Path | None = None, *,
                 wall: Callable[[], float] = time.time,
                 sync_status: Callable[[], str] = kernel_sync_status) -> None:
        self.skew_file = skew_file
        self._wall = wall
        self._sync_status = sync_status

    def now(self) -> float:
        """Unix seconds as this node reports them (wall clock plus test skew)."""
        return self._wall() + read_skew(self.skew_file)

    def sync_status(self) -> str:
        return self._sync_status()

    def reply(self, probe_id: int) -> ClockReply:
        """The ``clock_reply`` frame: the time is read last, closest to the send."""
        status = SyncStatus(self.sync_status())
        return ClockReply(id=probe_id, node_time=float(self.now()), sync_status=status)
