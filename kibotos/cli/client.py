"""The operator CLI's synchronous client for ctrl's HTTP API.

One place translates everything foreign into `kibotos.errors`: an ``{"error": …}``
response becomes the class its code names (`error_from_wire`), a refused or dropped
connection becomes `Unavailable` naming the URL, a timeout `DeadlineExceeded`.  Nothing
above this module sees an httpx exception.

Every write carries a ``command_id``: the caller's, or one generated per write call and
reused by the retries of that call, so a request that reached ctrl but whose answer was
lost is replayed by ctrl instead of being done twice.  Transport failures are retried a
few times (reads are safe, writes are replays); HTTP errors are not.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from kibotos.errors import (
    ERROR_CLASSES,
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    KibotosError,
    Unavailable,
    error_from_wire,
)
from kibotos.ids import new_id
from kibotos.tls.contexts import client_context, require_secure, verification_error

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

    def __init__(self, base_url: str, credential: str | None, *,
                 request_timeout: float = 30.0, deadline: Deadline | None = None,
                 transport: httpx.BaseTransport | None = None,
                 verify: ssl.SSLContext | None = None) -> None:
        """`verify` checks ctrl's certificate (default: the system trust store); a
        plain ``http://`` ctrl is refused unless it is on loopback."""
        self.base_url = base_url.rstrip("/")
        if transport is None:
            require_secure(self.base_url, "ctrl_url")
        self.request_timeout = request_timeout
        self.deadline = deadline or Deadline(None)
        headers = {"User-Agent": "kibo"}
        if credential:
            headers["Authorization"] = f"Bearer {credential}"
        self._http = httpx.Client(base_url=self.base_url, headers=headers,
                                  transport=transport, follow_redirects=False,
                                  verify=verify or client_context())

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
              headers: dict[str, str] | None = None) -> httpx.Response:
        """One request, retried after transport failures; `content` makes a fresh body
        stream for each attempt."""
        attempt = 0
        while True:
            timeout = self._timeout()
            try:
                response = self._http.request(
                    method, path, params=params, json=body, timeout=timeout,
                    content=None if content is None else content(), headers=headers)
            except httpx.TimeoutException:
                raise DeadlineExceeded(
                    f"ctrl at {self.base_url} did not answer {method} {path} "
                    f"within {timeout:g}s") from None
            except httpx.TransportError as exc:
                unverified = verification_error(exc)
                if unverified is not None:  # retrying cannot fix it
                    raise FailedPrecondition(
                        f"ctrl at {self.base_url} presented a certificate that does not "
                        f"verify ({unverified.verify_message}): pin the CA that signed it "
                        "with `kibo enroll --ca-file` (ctrl's <state_dir>/cluster-ca.crt "
                        "unless the operator gave ctrl a certificate)") from None
                if attempt < len(RETRY_PAUSES) and not self._would_overrun(attempt):
                    time.sleep(RETRY_PAUSES[attempt])
                    attempt += 1
                    continue
                raise Unavailable(f"cannot reach ctrl at {self.base_url}: "
                                  f"{_describe_transport_error(exc)}") from None
            return response

    def _would_overrun(self, attempt: int) -> bool:
        remaining = self.deadline.remaining()
        return remaining is not None and remaining <= RETRY_PAUSES[attempt]


def resource_path(collection: str, resource_id: str, action: str = "") -> str:
    """``resource_path("/v1/nodes", "n 1", "drain")`` → ``/v1/nodes/n%201/drain``: the ID
    is quoted whole (no ``/`` survives), so an odd ID cannot reach another route."""
    path = f"{collection}/{quote(resource_id, safe='')}"
    return f"{path}/{action}" if action else path


def _describe_transport_error(exc: httpx.TransportError) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.ConnectError):
        return f"connection failed ({text})"
    return text


def _result(response: httpx.Response, method: str, url: str) -> Any:
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
