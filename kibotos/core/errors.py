"""The one exception tree of kibotos, and the one table that maps it outward.

::

    KibotosError                      code                 HTTP  exit
    ├── InvalidArgument               invalid_argument     400   10
    ├── Unauthenticated               unauthenticated      401   11
    ├── PermissionDenied              permission_denied    403   11
    ├── NotFound                      not_found            404   12
    ├── FailedPrecondition            failed_precondition  412   13
    ├── Aborted                       aborted              409   14   stale expected revision
    ├── AlreadyExists                 already_exists       409   14   command ID, other input
    ├── ResourceExhausted             resource_exhausted   429   15
    ├── DeadlineExceeded              deadline_exceeded    504   16
    ├── Unavailable                   unavailable          503   17
    └── Internal                      internal             500   1

The spec fixes exit codes 12 (not found), 13 (failed precondition) and 16 (timed out);
the rest are ours and are documented in docs/cli.md.  Foreign errors (SQLAlchemy,
pyroute2, D-Bus, subprocess) are translated at the boundary by ``map_*_errors``
helpers next to the code that calls them; nothing above that layer sees them.
"""

from __future__ import annotations

from typing import Any, ClassVar


class KibotosError(Exception):
    """Root of every error kibotos raises on purpose."""

    code: ClassVar[str] = "internal"
    http_status: ClassVar[int] = 500
    exit_code: ClassVar[int] = 1
    #: Whether the same request may succeed if sent again later.
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details or {}

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            body["details"] = self.details
        return {"error": body}


class InvalidArgument(KibotosError):
    code = "invalid_argument"
    http_status = 400
    exit_code = 10


class Unauthenticated(KibotosError):
    code = "unauthenticated"
    http_status = 401
    exit_code = 11


class PermissionDenied(KibotosError):
    code = "permission_denied"
    http_status = 403
    exit_code = 11


class NotFound(KibotosError):
    code = "not_found"
    http_status = 404
    exit_code = 12


class FailedPrecondition(KibotosError):
    code = "failed_precondition"
    http_status = 412
    exit_code = 13


class Aborted(KibotosError):
    code = "aborted"
    http_status = 409
    exit_code = 14
    retryable = True


def check_expected_version(what: str, key: str, object_id: str, current: int,
                           expected: int | None, field: str = "revision") -> None:
    """The optimistic check of every versioned write: an `expected` version (the
    caller's ``expected_version``) other than the record's `current` one is `Aborted`,
    said the same way for every kind of record (`what`, its ID under `key`)."""
    if expected is not None and expected != current:
        raise Aborted(
            f"{what} {object_id} is at {field} {current}, not {expected}: read it again and "
            "retry", details={key: object_id, field: current, "expected_version": expected})


class AlreadyExists(KibotosError):
    code = "already_exists"
    http_status = 409
    exit_code = 14


class ResourceExhausted(KibotosError):
    code = "resource_exhausted"
    http_status = 429
    exit_code = 15
    retryable = True


class DeadlineExceeded(KibotosError):
    code = "deadline_exceeded"
    http_status = 504
    exit_code = 16
    retryable = True


class Unavailable(KibotosError):
    code = "unavailable"
    http_status = 503
    exit_code = 17
    retryable = True


class Internal(KibotosError):
    code = "internal"
    http_status = 500
    exit_code = 1


ERROR_CLASSES: dict[str, type[KibotosError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        Unauthenticated,
        PermissionDenied,
        NotFound,
        FailedPrecondition,
        Aborted,
        AlreadyExists,
        ResourceExhausted,
        DeadlineExceeded,
        Unavailable,
        Internal,
    )
}


def error_from_wire(body: dict[str, Any]) -> KibotosError:
    """Rebuild the error a server sent as ``{"error": {"code", "message"}}``."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return Internal(f"malformed error response: {body!r}")
    return error_of(err)


def error_of(err: dict[str, Any], unknown: type[KibotosError] = Internal) -> KibotosError:
    """The error a peer described as ``{"code", "message", "details"?}`` (ctrl, the
    guest agent); a code this side does not know becomes `unknown`."""
    cls = ERROR_CLASSES.get(str(err.get("code")), unknown)
    details = err.get("details")
    return cls(str(err.get("message", "")), details=details if isinstance(details, dict) else None)
