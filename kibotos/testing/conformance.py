"""What the conformance suites share: how they get the backend under test (its class and
options) and how their checks are named in test IDs.

Every backend is built as ``cls(options)`` by the role that uses it, so that is what a
suite needs, and all it needs: `BackendFactory` builds a fresh object each call (what a
restarted node builds), or one with extra options (to check that a typo is refused).
It pickles when the class is importable and the options are plain data, which the
supervisor suite uses to build the same supervisor in a separate process.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")
E = TypeVar("E", bound=BaseException)


@dataclass(frozen=True)
class BackendFactory(Generic[T]):
    """``BackendFactory(DirectSupervisor, {"state_dir": "/tmp/units"})``."""

    cls: type[T]
    options: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self) -> T:
        return self.cls(dict(self.options))  # type: ignore[call-arg]

    def with_options(self, **extra: Any) -> T:
        """The backend with `extra` options added to (or replacing) the base ones."""
        return self.cls({**self.options, **extra})  # type: ignore[call-arg]


def check_id(check: Callable[..., object]) -> str:
    """A check's name without ``check_``, for ``pytest.mark.parametrize(ids=...)``."""
    return str(getattr(check, "__name__", check)).removeprefix("check_")


def expect_raises(kind: type[E], call: Callable[[], object], what: str) -> E:
    """The `kind` exception `call` raised, for the check to look at; fails naming
    `what` if it raised none (the suites do not depend on pytest)."""
    try:
        call()
    except kind as exc:
        return exc
    raise AssertionError(f"{what} was not refused with {kind.__name__}")


async def expect_raises_async(kind: type[E], call: Callable[[], Awaitable[object]],
                              what: str) -> E:
    """`expect_raises` for an async call."""
    try:
        await call()
    except kind as exc:
        return exc
    raise AssertionError(f"{what} was not refused with {kind.__name__}")
