"""Reading a TOML configuration file with errors that name it, free of pydantic so that
`kibo`'s own config (`kibotos.cli.core.kibo_config`, kept light for start-up time) and the
validated configs of `kibotos.config` read files the same way."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from kibotos.core.errors import InvalidArgument


def read_toml(path: Path) -> dict[str, Any]:
    """The table in `path`; a missing, unreadable or malformed file is `InvalidArgument`."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise InvalidArgument(f"configuration file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"configuration file {path} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise InvalidArgument(f"cannot read configuration file {path}: {exc}") from None
