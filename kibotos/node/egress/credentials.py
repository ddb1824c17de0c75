"""Egress credentials on the node: fetched from ctrl by Egress revision with the node's
own identity, kept one file per revision, deleted as soon as nothing references them.

``<storage.root>/state/egress-credentials/<name>@<revision>.json``: the directory 0700,
each file 0600, both root's (spec: "Egress processes").  A file is written atomically
(`kibotos.core.atomicfile`) before the revision is used, so a node that restarts restores
its egress from these files alone, without contacting ctrl; ctrl is asked only for a
revision that has no file.  The password appears in no log, no error and no ``repr``.

ctrl's endpoint: ``GET /v1/egresses/{name}/credentials?revision=N`` with the node's
bearer credential, answering ``{name, revision, username, password}``.  Secrets never
travel in clear text off the host: the client refuses an ``http://`` ctrl that is not
on loopback.
"""

from __future__ import annotations

import contextlib
import os
import re
import ssl
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import trio

from kibotos.core import atomicfile
from kibotos.core.errors import FailedPrecondition, InvalidArgument, KibotosError, Unavailable
from kibotos.core.logs import EventLogger
from kibotos.node.session.ctrl_http import CtrlUrls, refusal
from kibotos.tls.contexts import client_context, require_secure

log = EventLogger()

DIRECTORY = "egress-credentials"
FORMAT = 1
_NAME = re.compile(r"[a-z0-9](?:[a-z0-9.-]{0,61}[a-z0-9])?")
_FILE = re.compile(r"(?P<name>[a-z0-9.-]+)@(?P<revision>[0-9]+)\.json")

Key = tuple[str, int]


@dataclass(frozen=True)
class Credential:
    name: str
    revision: int
    username: str | None
    password: str | None = field(repr=False)

    @property
    def key(self) -> Key:
        return self.name, self.revision


def _secret(value: Any, what: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value.encode()) <= 255:
        raise InvalidArgument(f"{what} must be a string of 1-255 bytes")
    return value


def parse_credential(value: Any, name: str, revision: int, source: str) -> Credential:
    """A credential as ctrl answers it (or as its file holds it), for exactly this
    Egress revision; the error names the field, never its value."""
    if not isinstance(value, dict):
        raise InvalidArgument(f"egress credentials from {source} are not a JSON object")
    keys = set(value) - {"format", "fetched_at"}
    if keys != {"name", "revision", "username", "password"}:
        raise InvalidArgument(f"egress credentials from {source} have the fields "
                              f"{sorted(keys)}, expected name, revision, username, password")
    if value["name"] != name or value["revision"] != revision or \
            isinstance(value["revision"], bool):
        raise InvalidArgument(f"egress credentials from {source} are for "
                              f"{value['name']!r} revision {value['revision']!r}, not "
                              f"{name} revision {revision}")
    username = _secret(value["username"], f"the username from {source}")
    password = _secret(value["password"], f"the password from {source}")
    if (username is None) != (password is None):
        raise InvalidArgument(f"egress credentials from {source}: a username needs a "
                              "password and the other way round")
    return Credential(name, revision, username, password)


def check_key(name: object, revision: object) -> Key:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgument(f"invalid egress name {name!r}")
    if not isinstance(revision, int) or isinstance(revision, bool) or revision < 1:
        raise InvalidArgument(f"invalid egress revision {revision!r}")
    return name, revision


class CredentialClient:
    """Fetches one Egress revision's credentials from ctrl with the node's identity."""

    def __init__(self, ctrl_url: str | Sequence[str],
                 credential: str | Callable[[], str | None], *,
                 http: httpx.AsyncClient | None = None, timeout: float = 30.0,
                 verify: ssl.SSLContext | None = None) -> None:
        #: ctrl's replicas: a fetch that cannot reach one is retried on the next.
        self.urls = CtrlUrls(ctrl_url)
        for url in self.urls.all:
            require_secure(url, "egress credentials are secrets: ctrl URL")
        self.verify = verify or client_context()
        self._credential = credential
        self._http = http
        self._timeout = timeout

    def _headers(self) -> dict[str, str]:
        cred = self._credential() if callable(self._credential) else self._credential
        return {"Authorization": f"Bearer {cred}"} if cred else {}

    @property
    def ctrl_url(self) -> str:
        return self.urls.current

    async def fetch(self, name: str, revision: int) -> Credential:
        check_key(name, revision)
        base = self.urls.current
        url = f"{base}/v1/egresses/{quote(name, safe='')}/credentials"
        what = f"fetch the credentials of egress {name} revision {revision}"
        try:
            if self._http is not None:
                resp = await self._http.get(url, params={"revision": revision},
                                            headers=self._headers())
            else:
                async with httpx.AsyncClient(timeout=self._timeout,
                                             verify=self.verify) as client:
                    resp = await client.get(url, params={"revision": revision},
                                            headers=self._headers())
        except httpx.TransportError as exc:
            self.urls.failed(base)
            raise Unavailable(f"{what}: cannot reach ctrl at {base}: "
                              f"{exc or type(exc).__name__}") from None
        if resp.status_code != 200:
            raise refusal(resp, what)
        try:
            body = resp.json()
        except ValueError:
            raise Unavailable(f"{what}: ctrl answered with something that is not JSON") \
                from None
        if not isinstance(body, dict) or "result" not in body:
            raise InvalidArgument(f"{what}: ctrl's answer has no 'result'")
        answer = body["result"]
        if isinstance(answer, dict):  # the address is the policy's, already known
            answer = {k: v for k, v in answer.items() if k != "address"}
        return parse_credential(answer, name, revision, "ctrl")


class CredentialStore:
    """The credential files of one node, and the fetches that fill them."""

    def __init__(self, state_dir: Path, client: CredentialClient | None, *,
                 prefix: str = "") -> None:
        self.directory = state_dir / DIRECTORY
        self.client = client
        self.prefix = prefix  # of temporary files (atomicfile)
        self._lock = trio.Lock()

    def path(self, name: str, revision: int) -> Path:
        check_key(name, revision)
        return self.directory / f"{name}@{revision}.json"

    def _ensure_directory(self) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(self.directory)
        if info.st_uid != os.geteuid() or info.st_mode & 0o077:
            os.chown(self.directory, os.geteuid(), os.getegid())
            os.chmod(self.directory, 0o700)

    def load(self, name: str, revision: int) -> Credential | None:
        """The revision's file, or None when there is none (or it is unusable: logged,
        then fetched again by `ensure`)."""
        path = self.path(name, revision)
        try:
            value = atomicfile.read_json(path)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.error("egress credentials file unreadable", path=path, error=str(exc))
            return None
        try:
            return parse_credential(value, name, revision, str(path))
        except InvalidArgument as exc:
            log.error("egress credentials file damaged", path=path, error=exc.message)
            return None

    def _write(self, credential: Credential) -> None:
        self._ensure_directory()
        atomicfile.write_json(self.path(*credential.key), {
            "format": FORMAT, "name": credential.name, "revision": credential.revision,
            "username": credential.username, "password": credential.password,
        }, prefix=self.prefix, mode=0o600)

    async def ensure(self, name: str, revision: int) -> Credential:
        """The revision's credentials: from its file, or fetched from ctrl and written
        before this returns."""
        async with self._lock:
            found = await trio.to_thread.run_sync(self.load, name, revision)
            if found is not None:
                return found
            if self.client is None:
                raise FailedPrecondition(f"no credentials of egress {name} revision "
                                         f"{revision} on this node, and no ctrl to ask")
            credential = await self.client.fetch(name, revision)
            await trio.to_thread.run_sync(self._write, credential)
            log.info("egress credentials fetched", egress=name, revision=revision)
            return credential

    def stored(self) -> list[Key]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        keys = []
        for entry in names:
            match = _FILE.fullmatch(entry)
            if match is not None:
                keys.append((match["name"], int(match["revision"])))
        return sorted(keys)

    def retain_only(self, referenced: Iterable[Key]) -> list[Key]:
        """Delete every revision not in `referenced` (and leftovers of interrupted
        writes); the revisions deleted."""
        keep = set(referenced)
        removed = [key for key in self.stored() if key not in keep]
        for key in removed:
            with contextlib.suppress(FileNotFoundError):
                self.path(*key).unlink()
        with contextlib.suppress(FileNotFoundError):
            for entry in os.listdir(self.directory):
                if entry.startswith(".") and entry.endswith(".tmp"):
                    with contextlib.suppress(FileNotFoundError):
                        (self.directory / entry).unlink()
        if removed:
            atomicfile.fsync_dir(self.directory)
            log.info("egress credentials deleted",
                     revisions=" ".join(f"{n}@{r}" for n, r in removed))
        return removed


def error_text(exc: KibotosError) -> str:
    """An error's message for a log line (they never carry a secret)."""
    return exc.message
