"""Shared fixtures of the plugin tests: a clean plugin environment and throwaway
plugin modules written into a temporary directory on ``sys.path``."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kibotos.plugins import DISABLE_ENV, EXTRA_MODULES_ENV

HERE = Path(__file__).parent

WriteModule = Callable[[str, str], str]


@pytest.fixture(autouse=True)
def clean_plugin_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No block list or test modules leak in from the environment of the test run."""
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    monkeypatch.delenv(EXTRA_MODULES_ENV, raising=False)


@pytest.fixture
def write_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[WriteModule]:
    """Write a plugin module under a unique name into a directory on sys.path."""
    moddir = tmp_path / "modules"
    moddir.mkdir()
    monkeypatch.syspath_prepend(str(moddir))
    written: list[str] = []

    def write(name: str, source: str) -> str:
        (moddir / f"{name}.py").write_text(textwrap.dedent(source))
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)
