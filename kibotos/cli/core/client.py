"""The operator CLI's synchronous client for ctrl's HTTP API.

One place translates everything foreign into `kibotos.core.errors`: an ``{"error": …}``
response becomes the class its code names (`error_from_wire`), a refused or dropped
connection becomes `Unavailable` naming the URL, a timeout `DeadlineExceeded`.  Nothing
above this module sees a socket or protocol exception.  The connection itself
(TLS verification, proxies, keep-alive) is `kibotos.cli.core.http_transport`: the standard
library, because httpx's import alone cost every command a quarter of a second.

Every write carries a ``command_id``: the caller's, or one generated per write call and
reused by the retries of that call, so a request that reached ctrl but whose answer was
lost is replayed by ctrl instead of being done twice.  Transport failures are retried a
few times (reads are safe, writes are replays); HTTP errors are not.  Given several
ctrl URLs (the replicas of one cluster, docs/replicas.md), a transport failure moves to
the next at once, and the pauses come only after every URL failed; the one that
answered last is used first for the invocation's next requests.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from kibotos.cli.core.http_transport import ConnectError, Connection, Target
from kibotos.core.errors import (
    ERROR_CLASSES,
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    KibotosError,
    Unavailable,
    error_from_wire,
)
from kibotos.core.ids import new_id
from kibotos.tls.contexts import require_secure, verification_error

if TYPE_CHECKING:
    import ssl

_STATUS_CLASSES: dict[int, type[KibotosError]] = {}
for _cls in ERROR_CLASSES.values():
    _STATUS_CLASSES.setdefault(_cls.http_status, _cls)
_STATUS_CLASSES[409] = Aborted

#: Pauses between attempts after a transport failure (so three attempts in all).
RETRY_PAUSES = (0.25, 1.0)


class Deadline:
    """The global ``--timeout`` of one invocation: a point on the monotonic clock."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.at = None if seconds is None else time.monotonic() + seconds

    def remaining(self) -> float | None:
        return None if self.at is None else self.at - time.monotonic()

    def expired(self) -> bool:
        remaining = self.remaining()
        return remaining is not None and remaining <= 0


class Client:
    """Calls ctrl at `base_url` as the identity whose bearer `credential` is given.

    `request_timeout` bounds each HTTP request; `deadline` bounds the whole invocation
    and shortens the last requests so the command ends when the user said.
    """

    def __init__(self, base_url: str | Sequence[str], credential: str | None, *,
                 request_timeout: float = 30.0, deadline: Deadline | None = None,
                 verify: ssl.SSLContext | None = None) -> None:
        """`base_url` is one ctrl URL or the replicas' URLs in the order to try them.
        `verify` checks ctrl's certificate (default: the system trust store, made only
        for an ``https://`` ctrl); a plain ``http://`` ctrl is refused unless it is on
        loopback."""
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise InvalidArgument("ctrl_url: at least one URL is needed")
        self.base_urls = [url.rstrip("/") for url in urls]
        self.request_timeout = request_timeout
        self.deadline = deadline or Deadline(None)
        self._headers = {"User-Agent": "kibo", "Accept": "*/*"}
        if credential:
            self._headers["Authorization"] = f"Bearer {credential}"
        self._targets = [Target.parse(url) for url in self.base_urls]
        for url in self.base_urls:
            require_secure(url, "ctrl_url")
        self._verify = verify
        self._current = 0
        self._http = Connection(self._targets[0], tls=verify)

    @property
    def base_url(self) -> str:
        """The URL requests go to now."""
        return self.base_urls[self._current]

    @property
    def _target(self) -> Target:
        return self._targets[self._current]

    def _next_url(self) -> None:
        """Move to the next ctrl URL (after a transport failure on this one)."""
        self._http.close()
        self._current = (self._current + 1) % len(self._targets)
        self._http = Connection(self._targets[self._current], tls=self._verify)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ requests

    def get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        query = {k: v for k, v in (params or {}).items() if v is not None}
        return self._request("GET", path, params=query)

    def post(self, path: str, body: dict[str, Any] | None = None, *,
             write: bool = True) -> Any:
        return self._request("POST", path, body=self._with_command_id(body, write))

    def put(self, path: str, body: dict[str, Any] | None = None) -> Any:
        return self._request("PUT", path, body=self._with_command_id(body, True))

    def delete(self, path: str, body: dict[str, Any] | None = None) -> Any:
        return self._request("DELETE", path, body=self._with_command_id(body, True))

    def exists(self, path: str) -> bool:
        """Whether ``HEAD path`` finds something (404: no; other errors raise)."""
        response = self._send("HEAD", path, params=None, body=None, content=None)
        if response.is_success:
            return True
        if response.status_code == 404:
            return False
        _result(response, "HEAD", f"{self.base_url}{path}")  # raises what the status means
        raise Internal(f"ctrl answered HEAD {path} with HTTP {response.status_code}")

    def put_file(self, path: str, file: Path, *, piece: int = 1 << 20) -> Any:
        """``PUT path`` with the bytes of `file` as the body, streamed (never read
        whole into memory); a retry after a transport failure starts the file again."""
        size = file.stat().st_size

        def content() -> Iterator[bytes]:
            with open(file, "rb") as f:
                while chunk := f.read(piece):
                    yield chunk

        response = self._send("PUT", path, params=None, body=None, content=content,
                              headers={"Content-Length": str(size),
                                       "Content-Type": "application/octet-stream"})
        return _result(response, "PUT", f"{self.base_url}{path}")

    @staticmethod
    def _with_command_id(body: dict[str, Any] | None, write: bool) -> dict[str, Any]:
        sent = {k: v for k, v in (body or {}).items() if v is not None}
        if write and not sent.get("command_id"):
            sent["command_id"] = new_id("kibo")
        return sent

    def _timeout(self) -> float:
        remaining = self.deadline.remaining()
        if remaining is None:
            return self.request_timeout
        if remaining <= 0:
            raise DeadlineExceeded(
                f"the global --timeout of {self.deadline.seconds:g}s passed")
        return min(self.request_timeout, remaining)

    def _request(self, method: str, path: str, *, params: dict[str, Any] | None = None,
                 body: dict[str, Any] | None = None) -> Any:
        response = self._send(method, path, params=params, body=body, content=None)
        return _result(response, method, f"{self.base_url}{path}")

    def _send(self, method: str, path: str, *, params: dict[str, Any] | None,
              body: dict[str, Any] | None, content: Callable[[], Iterator[bytes]] | None,
              headers: dict[str, str] | None = None) -> Response:
        """One request, retried after transport failures; `content` makes a fresh body
        stream for each attempt."""
        target = self._target.prefix + path
        if params:
            target += "?" + urlencode({k: _query_value(v) for k, v in params.items()})
        sent = {**self._headers, **(headers or {})}
        encoded: bytes | None = None
        if body is not None:
            # As httpx encodes ``json=``: compact, UTF-8, no NaN.
            encoded = json.dumps(body, ensure_ascii=False, separators=(",", ":"),
                                 allow_nan=False).encode()
            sent["Content-Type"] = "application/json"
        attempt = 0
        failed_urls = 0  # in this round of attempts
        while True:
            timeout = self._timeout()
            try:
                answer = self._http.request(
                    method, target, body=encoded if content is None else content(),
                    headers=sent, timeout=timeout)
            except TimeoutError:
                raise DeadlineExceeded(
                    f"ctrl at {self.base_url} did not answer {method} {path} "
                    f"within {timeout:g}s") from None
            except OSError as exc:
                # Only TLS can fail verification (and ssl is not even imported for http).
                unverified = (verification_error(exc)
                              if self._target.scheme == "https" else None)
                if unverified is not None:  # retrying cannot fix it
                    raise FailedPrecondition(
                        f"ctrl at {self.base_url} presented a certificate that does not "
                        f"verify ({unverified.verify_message}): pin the CA that signed it "
                        "with `kibo enroll --ca-file` (ctrl's <state_dir>/cluster-ca.crt "
                        "unless the operator gave ctrl a certificate)") from None
                failed_urls += 1
                if failed_urls < len(self._targets):
                    self._next_url()  # another replica, at once
                    continue
                if attempt < len(RETRY_PAUSES) and not self._would_overrun(attempt):
                    time.sleep(RETRY_PAUSES[attempt])
                    attempt += 1
                    failed_urls = 0
                    self._next_url()  # the round starts again where the last did
                    continue
                where = (self.base_url if len(self._targets) == 1
                         else f"any of {', '.join(self.base_urls)}")
                raise Unavailable(f"cannot reach ctrl at {where}: "
                                  f"{_describe_transport_error(exc)}") from None
            return Response(answer.status, answer.reason, answer.content)

    def _would_overrun(self, attempt: int) -> bool:
        remaining = self.deadline.remaining()
        return remaining is not None and remaining <= RETRY_PAUSES[attempt]


def resource_path(collection: str, resource_id: str, action: str = "") -> str:
    """``resource_path("/v1/nodes", "n 1", "drain")`` → ``/v1/nodes/n%201/drain``: the ID
    is quoted whole (no ``/`` survives), so an odd ID cannot reach another route."""
    path = f"{collection}/{quote(resource_id, safe='')}"
    return f"{path}/{action}" if action else path


@dataclass(frozen=True)
class Response:
    """What ctrl answered: the status line and the whole body."""

    status_code: int
    reason_phrase: str
    content: bytes

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


def _query_value(value: Any) -> str:
    """A query parameter as httpx writes it: booleans lower case."""
    if value is True or value is False:
        return "true" if value else "false"
    return str(value)


def _describe_transport_error(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, ConnectError):
        return f"connection failed ({text})"
    return text


def _result(response: Response, method: str, url: str) -> Any:
    """The ``result`` of a success, or the error the response stands for, raised."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.is_success:
        if isinstance(body, dict) and "result" in body:
            return body["result"]
        raise Internal(f"ctrl answered {method} {url} with HTTP {response.status_code} "
                       f"but no result: {response.text[:200]!r}")
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        raise error_from_wire(body)
    cls = _STATUS_CLASSES.get(response.status_code, Internal)
    raise cls(f"ctrl answered {method} {url} with HTTP {response.status_code}: "
              f"{response.text[:200].strip() or response.reason_phrase}")
