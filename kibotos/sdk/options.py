"""A backend's options, read key by key with one message format.

Every backend class is built as ``cls(options)``: a VMM backend from the node's
``[vmm.<name>]`` table, a supervisor from ``[supervisor.<name>]``, a storage driver or a
placement policy from an empty mapping (they have no table).  Each built-in backend used
to check its table its own way ("qemu backend: unknown options ['x']", "supervisor
direct needs the option state_dir", "storage driver local takes no options, got x"),
and some coerced what they were given (``float("20")``).  `BackendOptions` checks
types without coercing and words every refusal the same way, naming the table an
operator edits::

    [vmm.qemu]: unknown option colour (known: accelerator, cache_dir, …)
    [vmm.qemu] probe_timeout: must be a positive number of seconds, got -1
    [supervisor.direct] state_dir: required, not given
    storage driver local: unknown option colour (it takes none)

All refusals are `kibotos.core.errors.InvalidArgument`, raised from the constructor, so a
node with a bad table fails at start and names it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from kibotos.core.errors import InvalidArgument

Kind = Literal["vmm", "supervisor", "storage_driver", "placement"]

#: How a refusal names the backend: the configuration table it reads, or, for kinds
#: without a table, the kind and name.
_WHERE: Mapping[str, str] = {
    "vmm": "[vmm.{name}]",
    "supervisor": "[supervisor.{name}]",
    "storage_driver": "storage driver {name}",
    "placement": "placement policy {name}",
}


def backend_options(kind: Kind, name: str, options: Mapping[str, Any],
                    known: Iterable[str] = ()) -> BackendOptions:
    """`options` of the `kind` backend `name`, refused at once if it has a key not in
    `known` (a typo must not be silently ignored)."""
    return BackendOptions(_WHERE[kind].format(name=name), options, known)


class BackendOptions:
    """One backend's options; each reader returns the value or its default, or raises
    ``InvalidArgument("<where> <key>: <problem>, got <value>")``."""

    def __init__(self, where: str, options: Mapping[str, Any], known: Iterable[str]) -> None:
        if not isinstance(options, Mapping):
            raise InvalidArgument(f"{where}: the options must be a table, got {options!r}")
        self.where = where
        self._options = options
        known = sorted(set(known))
        unknown = sorted(str(k) for k in options if k not in known)
        if unknown:
            plural = "s" if len(unknown) > 1 else ""
            choices = f"known: {', '.join(known)}" if known else "it takes none"
            raise InvalidArgument(
                f"{where}: unknown option{plural} {', '.join(unknown)} ({choices})")

    def __contains__(self, key: str) -> bool:
        return key in self._options

    def invalid(self, key: str, problem: str) -> InvalidArgument:
        """The error for a value of `key` that is wrong because of `problem`."""
        return InvalidArgument(f"{self.where} {key}: {problem}, got {self._options.get(key)!r}")

    # ------------------------------------------------------------------ readers

    def text(self, key: str, default: str) -> str:
        """A non-empty string."""
        found = self.text_or_none(key)
        return default if found is None else found

    def text_or_none(self, key: str) -> str | None:
        if key not in self._options:
            return None
        value = self._options[key]
        if not isinstance(value, str) or not value:
            raise self.invalid(key, "must be a non-empty string")
        return value

    def path(self, key: str, default: str | Path, *, absolute: bool = False) -> Path:
        """A file system path (a non-empty string); `absolute` refuses a relative one."""
        found = self.path_or_none(key, absolute=absolute)
        return Path(default) if found is None else found

    def path_or_none(self, key: str, *, absolute: bool = False) -> Path | None:
        if key not in self._options:
            return None
        value = self._options[key]
        if not isinstance(value, str | os.PathLike) or not os.fspath(value):
            raise self.invalid(key, "must be a path")
        path = Path(value)
        if absolute and not path.is_absolute():
            raise self.invalid(key, "must be an absolute path")
        return path

    def required_path(self, key: str, *, absolute: bool = False) -> Path:
        found = self.path_or_none(key, absolute=absolute)
        if found is None:
            raise InvalidArgument(f"{self.where} {key}: required, not given")
        return found

    def integer(self, key: str, default: int, lo: int, hi: int) -> int:
        """An integer from `lo` to `hi` (true and false are not integers here)."""
        value = self._options.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise self.invalid(key, f"must be an integer from {lo} to {hi}")
        return value

    def seconds(self, key: str, default: float, *, most: float | None = None) -> float:
        """A positive number of seconds, at most `most` when given."""
        value = self._options.get(key, default)
        if (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0
                or (most is not None and value > most)):
            limit = f" up to {most:g}" if most is not None else ""
            raise self.invalid(key, f"must be a positive number of seconds{limit}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self._options.get(key, default)
        if not isinstance(value, bool):
            raise self.invalid(key, "must be true or false")
        return value

    def choice(self, key: str, default: str, choices: Sequence[str]) -> str:
        value = self._options.get(key, default)
        if not isinstance(value, str) or value not in choices:
            raise self.invalid(key, f"must be one of {', '.join(choices)}")
        return value
