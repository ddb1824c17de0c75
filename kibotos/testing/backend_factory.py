"""How the conformance suites get the backend under test: its class and options.

Every backend is built as ``cls(options)`` by the role that uses it, so that is what a
suite needs, and all it needs: `BackendFactory` builds a fresh object each call (what a
restarted node builds), or one with extra options (to check that a typo is refused).
It pickles when the class is importable and the options are plain data, which the
supervisor suite uses to build the same supervisor in a separate process.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


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
