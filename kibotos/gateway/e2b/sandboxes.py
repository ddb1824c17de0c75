"""What a sandbox is to the gateway: a Workspace, plus the few things E2B's API has and
a Workspace has no field for, kept in the gateway's state directory.

* IDs: a Workspace ``ws-<26 base32>`` is the sandbox ``<26 base32>`` (E2B's IDs are
  lowercase letters and digits, no ``-``, because ``<port>-<id>.<domain>`` is split on
  it); both directions are pure functions, so nothing maps one onto the other.
* The team: the label `TEAM_LABEL` ctrl keeps on the Workspace, set at create.  It is
  what the gateway checks on every call, so a lost state directory cannot widen what a
  key sees.
* The record (`SandboxRecord`, ``<state_dir>/sandboxes/<id>.json``, written atomically):
  E2B's template ID as asked, metadata (arbitrary strings, which labels cannot hold),
  ``envVars`` (every process's default environment), the end of its lifetime and what
  happens then (kill or pause).  A Workspace of the team without a record is still
  shown (empty metadata, no timeout): the record adds, it never decides access.
* The envd access token: HMAC-SHA256 of the sandbox ID under the gateway's own key
  (``<state_dir>/token.key``), so it is never stored and survives a lost record; every
  envd call must carry it (every sandbox is "secure"), and only a key of the team gets
  it, from create, connect or get.
* The traffic access token of a sandbox created with ``allowPublicTraffic: false``:
  32 random bytes, in the record (create and connect hand it out), its digest in the
  Workspace's `TRAFFIC_LABEL` (set at create, before the ID is known, so it cannot be
  derived from the ID as the envd token is), which the Exposure gateway checks.  A
  lost record loses the token: the sandbox's ports then stay closed, never open.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kibotos.core import atomicfile
from kibotos.core.errors import FailedPrecondition, NotFound
from kibotos.gateway.common import sandbox_labels

TEAM_LABEL = sandbox_labels.TEAM_LABEL
WORKSPACE_PREFIX = "ws-"
RECORD_FORMAT = 1
#: The envd version the gateway speaks (the SDK gates features on it): default user
#: (0.4.0), stdin and CloseStdin (0.5.2), octet-stream uploads (0.5.7); not file
#: metadata (0.6.2) nor watch entries (0.6.3).
ENVD_VERSION = "0.5.7"
#: E2B's states, from Workspace states: what a caller can use, and what a connect
#: resumes.  The others (FAILED, DELETING, DELETED) are no sandbox any more.
RUNNING_STATES = ("CREATING", "STARTING", "AVAILABLE")
PAUSED_STATES = ("STOPPING", "STOPPED")
_SANDBOX_ID = re.compile(r"[0-9a-z]{26}")


def workspace_id(sandbox_id: str) -> str:
    """The Workspace of a sandbox ID; `NotFound` for an ID no Workspace can have."""
    if not isinstance(sandbox_id, str) or not _SANDBOX_ID.fullmatch(sandbox_id):
        raise NotFound(f"sandbox {sandbox_id!r} not found")
    return WORKSPACE_PREFIX + sandbox_id


def sandbox_id(workspace_id: str) -> str:
    return workspace_id.removeprefix(WORKSPACE_PREFIX)


def e2b_state(ws_state: str) -> str | None:
    if ws_state in RUNNING_STATES:
        return "running"
    if ws_state in PAUSED_STATES:
        return "paused"
    return None


@dataclass
class SandboxRecord:
    sandbox_id: str
    team: str
    template_id: str
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    #: Unix time the sandbox's lifetime ends; None: never.
    end_at: float | None = None
    #: ``kill`` (delete the Workspace) or ``pause`` (stop it, the layer kept).
    on_timeout: str = "kill"
    #: ``autoResume``: traffic wakes it when paused (its Workspace also carries
    #: `sandbox_labels.AUTO_RESUME_LABEL`, which the Exposure gateway reads).
    auto_resume: bool = False
    #: The traffic access token; None: the sandbox's traffic is public.
    traffic_token: str | None = None
    #: The Egress made for its ``egressProxy`` (deleted after the Workspace); None: none.
    egress: str | None = None
    #: The lifetime (seconds) it was created or last connected with: what a sandbox
    #: woken by traffic is given again.  None: records of before autoResume.
    timeout_s: int | None = None
    #: E2B's ``network`` as last asked (`wire.network_info`: no password), and
    #: ``allow_internet_access``; what a get shows.  None: not asked.
    network: dict[str, Any] | None = None
    allow_internet_access: bool | None = None

    def to_json(self) -> dict[str, Any]:
        return {"format": RECORD_FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, data: Any, where: Path) -> SandboxRecord:
        if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT:
            raise FailedPrecondition(f"sandbox record {where} is not of format "
                                     f"{RECORD_FORMAT}")
        body = {k: v for k, v in data.items() if k != "format"}
        try:
            return cls(**body)
        except TypeError as exc:
            raise FailedPrecondition(f"sandbox record {where} is malformed: {exc}") from None


class Records:
    """The records in ``<state_dir>/sandboxes``, loaded once and kept in memory; every
    change is written through (atomically) before it is acted on."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir / "sandboxes"
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._all: dict[str, SandboxRecord] = {}
        for path in sorted(self.dir.glob("*.json")):
            record = SandboxRecord.from_json(json.loads(path.read_text()), path)
            self._all[record.sandbox_id] = record

    def get(self, sandbox_id: str) -> SandboxRecord | None:
        return self._all.get(sandbox_id)

    def all(self) -> list[SandboxRecord]:
        return list(self._all.values())

    def put(self, record: SandboxRecord) -> None:
        data = json.dumps(record.to_json(), sort_keys=True).encode()
        atomicfile.write_bytes(self.dir / f"{record.sandbox_id}.json", data, mode=0o600)
        self._all[record.sandbox_id] = record

    def drop(self, sandbox_id: str) -> None:
        (self.dir / f"{sandbox_id}.json").unlink(missing_ok=True)
        self._all.pop(sandbox_id, None)


class AccessTokens:
    """Each sandbox's envd access token, derived from the gateway's key."""

    def __init__(self, state_dir: Path) -> None:
        path = state_dir / "token.key"
        try:
            self._key = path.read_bytes()
        except FileNotFoundError:
            self._key = os.urandom(32)
            atomicfile.write_bytes(path, self._key, mode=0o600)
        if len(self._key) != 32:
            raise FailedPrecondition(f"{path} must hold 32 bytes (delete it to make a new "
                                     "key: every sandbox's access token changes)")

    def token(self, sandbox_id: str) -> str:
        digest = hmac.new(self._key, sandbox_id.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def matches(self, sandbox_id: str, presented: str | None) -> bool:
        return presented is not None and hmac.compare_digest(
            self.token(sandbox_id).encode(), presented.encode())


def new_traffic_token() -> str:
    return base64.urlsafe_b64encode(os.urandom(32)).rstrip(b"=").decode()
