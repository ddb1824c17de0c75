"""``kibo.toml``: where the operator CLI finds ctrl and its credential.

Three keys, read by every ``kibo`` command before its first request, so this module is
the standard library only: the role configs in `kibotos.config` are pydantic models,
and importing pydantic (with the node's and ctrl's sections) cost a ``kibo`` command
about 0.15 s before it said anything.  The checks are as strict as theirs, with the
same messages: unknown keys are errors, types are checked and not coerced (a number
for ``timeout``, never a string or a boolean), and a bad file names the key.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kibotos.errors import InvalidArgument
from kibotos.toml_file import read_toml

#: Seconds per HTTP request when the file does not say.
DEFAULT_TIMEOUT = 30.0


@dataclass(frozen=True)
class KiboConfig:
    ctrl_url: str
    credential: str | None = None
    timeout: float = DEFAULT_TIMEOUT


def parse(data: dict[str, Any], source: str) -> KiboConfig:
    """The config in `data` (a parsed TOML document); every problem at once, each named
    by its key, as ``invalid configuration SOURCE: key: problem; …``."""
    problems: list[str] = []
    ctrl_url = data.get("ctrl_url")
    if "ctrl_url" not in data:
        problems.append("ctrl_url: Field required")
    elif not isinstance(ctrl_url, str):
        problems.append("ctrl_url: Input should be a valid string")
    credential = data.get("credential")
    if credential is not None and not isinstance(credential, str):
        problems.append("credential: Input should be a valid string")
    timeout = data.get("timeout", DEFAULT_TIMEOUT)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        problems.append("timeout: Input should be a valid number")
    elif not math.isfinite(timeout) or timeout <= 0:
        problems.append("timeout: Input should be a positive number of seconds")
    problems += [f"{key}: unknown key" for key in data
                 if key not in ("ctrl_url", "credential", "timeout")]
    if problems:
        raise InvalidArgument(f"invalid configuration {source}: {'; '.join(problems)}")
    assert isinstance(ctrl_url, str)
    assert isinstance(timeout, int | float)
    return KiboConfig(ctrl_url, credential, float(timeout))


def load(path: Path | str) -> KiboConfig:
    path = Path(path)
    data = read_toml(path)
    return parse(data, str(path))


def kibo_config_path(explicit: str | None) -> Path:
    """``--config``, else ``$KIBO_CONFIG``, else the XDG config directory's file."""
    if explicit:
        return Path(explicit)
    env = os.environ.get("KIBO_CONFIG")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "kibotos" / "kibo.toml"
