"""nftables in a network namespace: a script committed as one transaction, and the
ruleset read back as JSON, through libnftables (the library behind ``nft``).

`nft_run_cmd_from_buffer` is ``nft -f``: the whole script is one netlink batch that the
kernel commits entirely or, on any error, not at all (TESTBED: "a rejected batch rolls
back whole").  Every table here is written that way; nothing is changed rule by rule.
The library is called in-process, on a thread that joined the namespace
(`netns.in_netns`), because starting the ``nft`` program costs several milliseconds
where the library needs about one.  Calls are serialized (libnftables keeps some global
state).

A context is freed by a background thread, not by the caller: closing its netlink
socket waits for the kernel's deferred destruction of what the transaction replaced
(an RCU grace period, 10-20 ms here), and the transaction is in force before that.
The next call waits for the free (the same lock), so contexts never overlap.

This is the one module that translates nftables' failures.
"""

from __future__ import annotations

import ctypes
import json
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kibotos.core.errors import FailedPrecondition, Internal
from kibotos.node.network.netns import in_netns, in_scratch_netns

LIBRARY = "libnftables.so.1"
OUTPUT_JSON = 1 << 4  # NFT_CTX_OUTPUT_JSON

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_to_free: queue.SimpleQueue[int] = queue.SimpleQueue()
_reaper: threading.Thread | None = None


def _reap() -> None:
    lib = _library()
    while True:
        ctx = _to_free.get()
        with _lock:
            lib.nft_ctx_free(ctx)


def _free_later(ctx: int) -> None:
    global _reaper
    if _reaper is None:
        _reaper = threading.Thread(target=_reap, name="kibotos-nft-free", daemon=True)
        _reaper.start()
    _to_free.put(ctx)


def _library() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        try:
            lib = ctypes.CDLL(LIBRARY, use_errno=True)
        except OSError:
            raise FailedPrecondition(f"{LIBRARY} is not installed (Debian packages nftables "
                                     "and libnftables1): the node needs it to write the "
                                     "slot tables of [network]") from None
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
        for getter in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
            getattr(lib, getter).restype = ctypes.c_char_p
            getattr(lib, getter).argtypes = [ctypes.c_void_p]
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        _lib = lib
    return _lib


def _run(commands: list[tuple[str, bool]], what: str) -> str:
    """Run each ``(script, as_json)`` in one context of the calling thread's namespace;
    the output of the last.  A refused script raises, naming `what`."""
    lib = _library()
    with _lock:
        ctx = lib.nft_ctx_new(0)
        if not ctx:
            raise FailedPrecondition(f"{what}: libnftables could not start")
        try:
            lib.nft_ctx_buffer_output(ctx)
            lib.nft_ctx_buffer_error(ctx)
            output = ""
            for script, as_json in commands:
                lib.nft_ctx_output_set_flags(ctx, OUTPUT_JSON if as_json else 0)
                if lib.nft_run_cmd_from_buffer(ctx, script.encode()) != 0:
                    error = (lib.nft_ctx_get_error_buffer(ctx) or b"").decode(errors="replace")
                    # the script is ours: a refusal is a bug, or a kernel lacking a feature
                    raise Internal(f"{what}: nftables refused the transaction: "
                                   f"{error.strip() or 'no reason given'}")
                output = (lib.nft_ctx_get_output_buffer(ctx) or b"").decode()
            return output
        finally:
            _free_later(ctx)


def _in(netns: Path | None, fn: Callable[[], str], what: str) -> str:
    try:
        return in_netns(netns, fn)
    except OSError as exc:  # the namespace could not be joined
        raise FailedPrecondition(f"{what}: cannot enter {netns}: {exc.strerror or exc}") from None


def apply(netns: Path | None, script: str, what: str) -> None:
    """Commit `script` in `netns` as one transaction (all of it or nothing)."""
    _in(netns, lambda: _run([(script, False)], what), what)


def ruleset(netns: Path | None, what: str) -> list[dict[str, Any]]:
    """The namespace's whole ruleset as nft's JSON objects (``metainfo`` left out)."""
    return _objects(_in(netns, lambda: _run([("list ruleset", True)], what), what), what)


def canonical(script: str, what: str) -> list[dict[str, Any]]:
    """What the kernel makes of `script`: committed in a scratch namespace and listed,
    so it compares with a listing of a real one exactly (same library, same kernel)."""
    return _objects(in_scratch_netns(
        lambda: _run([(script, False), ("list ruleset", True)], what)), what)


def _objects(text: str, what: str) -> list[dict[str, Any]]:
    try:
        value = json.loads(text) if text.strip() else {"nftables": []}
        objects = value["nftables"]
    except (ValueError, KeyError, TypeError):
        raise Internal(f"{what}: nftables printed no JSON ruleset: {text[:200]!r}") from None
    return [o for o in objects if isinstance(o, dict) and "metainfo" not in o]
