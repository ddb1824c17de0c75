"""Running ``nft`` in a network namespace: a script as one transaction, and the ruleset
read back as JSON.

``nft -f`` applies a whole file as one netlink batch: the kernel commits all of it or,
on any error, none of it (TESTBED: "a rejected batch rolls back whole").  That is how
every table is written here; nothing is ever changed rule by rule.  This is the one
module that translates nft's failures.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from kibotos.errors import FailedPrecondition, Internal
from kibotos.node.network.netns import in_netns, in_scratch_netns

#: nft's own timeout guard: a script of a few hundred lines takes ~10 ms.
TIMEOUT = 30.0
_SEARCH = "/usr/sbin:/sbin:/usr/bin:/bin"


def nft_binary() -> str:
    found = shutil.which("nft", path=_SEARCH)
    if found is None:
        raise FailedPrecondition("nft is not installed (Debian package nftables): the node "
                                 "needs it to write the slot tables of [network]")
    return found


def _run(argv: list[str], script: str | None, what: str) -> str:
    try:
        proc = subprocess.run(argv, input=script, capture_output=True, text=True,
                              timeout=TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        raise FailedPrecondition(f"{what}: nft did not finish in {TIMEOUT:.0f} s") from None
    except OSError as exc:
        raise FailedPrecondition(f"{what}: cannot run nft: {exc.strerror}") from None
    if proc.returncode != 0:
        detail = proc.stderr.strip() or f"exit status {proc.returncode}"
        # the script is ours: nft refusing it is a bug or a kernel without a feature
        raise Internal(f"{what}: nft refused the transaction: {detail}")
    return proc.stdout


def apply(netns: Path | None, script: str, what: str) -> None:
    """Commit `script` in `netns` as one transaction (all of it or nothing)."""
    argv = [nft_binary(), "-f", "-"]
    in_netns(netns, lambda: _run(argv, script, what))


def ruleset(netns: Path | None, what: str) -> list[dict[str, Any]]:
    """The namespace's whole ruleset as nft's JSON objects (``metainfo`` left out)."""
    argv = [nft_binary(), "-j", "list", "ruleset"]
    return _objects(in_netns(netns, lambda: _run(argv, None, what)), what)


def canonical(script: str, what: str) -> list[dict[str, Any]]:
    """What the kernel makes of `script`: committed in a scratch namespace and listed,
    so it compares with a listing of a real one exactly (same nft, same kernel)."""
    nft = nft_binary()

    def load_and_list() -> str:
        _run([nft, "-f", "-"], script, what)
        return _run([nft, "-j", "list", "ruleset"], None, what)

    return _objects(in_scratch_netns(load_and_list), what)


def _objects(text: str, what: str) -> list[dict[str, Any]]:
    try:
        value = json.loads(text) if text.strip() else {"nftables": []}
        objects = value["nftables"]
    except (ValueError, KeyError, TypeError):
        raise Internal(f"{what}: nft printed no JSON ruleset: {text[:200]!r}") from None
    return [o for o in objects if isinstance(o, dict) and "metainfo" not in o]
