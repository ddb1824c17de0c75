"""``kibo.toml``: where the operator CLI finds ctrl and its credential.

Five keys, read by every ``kibo`` command before its first request, so this module is
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

from kibotos.core.errors import InvalidArgument
from kibotos.core.toml_file import read_toml

#: Seconds per HTTP request when the file does not say.
DEFAULT_TIMEOUT = 30.0


@dataclass(frozen=True)
class KiboConfig:
    #: The first of `ctrl_urls`: where requests go while it answers.
    ctrl_url: str
    credential: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    #: The CA (PEM text) ctrl's certificate is verified against, pinned by ``kibo enroll
    #: --ca-file``; None: the system trust store.
    ctrl_ca: str | None = None
    #: The cluster CA (PEM text) data-plane certificates chain to, as the enrollment
    #: exchange handed it out; `kibo workspace exec` and the others verify against it.
    cluster_ca: str | None = None
    #: Every ctrl replica's URL, in the order tried (``ctrl_url`` may be a list: a
    #: connection failure moves to the next, docs/replicas.md); `ctrl_url` alone when
    #: the file names one.
    ctrl_urls: tuple[str, ...] = ()


def _pem_problem(key: str, value: object) -> str | None:
    """What is wrong with the PEM CA text under `key`, if anything (cryptography is
    imported only when the file has one)."""
    if value is None:
        return None
    if not isinstance(value, str):
        return f"{key}: Input should be a valid string"
    from kibotos.tls.contexts import check_ca_pem

    try:
        check_ca_pem(value, "the value")
    except InvalidArgument as exc:
        return f"{key}: {exc.message}"
    return None


def parse(data: dict[str, Any], source: str) -> KiboConfig:
    """The config in `data` (a parsed TOML document); every problem at once, each named
    by its key, as ``invalid configuration SOURCE: key: problem; …``."""
    problems: list[str] = []
    ctrl_url = data.get("ctrl_url")
    urls: tuple[str, ...] = ()
    if "ctrl_url" not in data:
        problems.append("ctrl_url: Field required")
    elif isinstance(ctrl_url, str):
        urls = (ctrl_url,)
    elif isinstance(ctrl_url, list) and ctrl_url and all(isinstance(u, str)
                                                         for u in ctrl_url):
        urls = tuple(ctrl_url)
    else:
        problems.append("ctrl_url: Input should be a valid string or a non-empty list "
                        "of strings")
    credential = data.get("credential")
    if credential is not None and not isinstance(credential, str):
        problems.append("credential: Input should be a valid string")
    timeout = data.get("timeout", DEFAULT_TIMEOUT)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        problems.append("timeout: Input should be a valid number")
    elif not math.isfinite(timeout) or timeout <= 0:
        problems.append("timeout: Input should be a positive number of seconds")
    ctrl_ca, cluster_ca = data.get("ctrl_ca"), data.get("cluster_ca")
    problems += [p for p in (_pem_problem("ctrl_ca", ctrl_ca),
                             _pem_problem("cluster_ca", cluster_ca)) if p]
    problems += [f"{key}: unknown key" for key in data
                 if key not in ("ctrl_url", "credential", "timeout", "ctrl_ca", "cluster_ca")]
    if problems:
        raise InvalidArgument(f"invalid configuration {source}: {'; '.join(problems)}")
    assert urls
    assert isinstance(timeout, int | float)
    assert ctrl_ca is None or isinstance(ctrl_ca, str)
    assert cluster_ca is None or isinstance(cluster_ca, str)
    return KiboConfig(urls[0], credential, float(timeout), ctrl_ca, cluster_ca, urls)


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
