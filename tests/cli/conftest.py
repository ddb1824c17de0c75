"""Shared fixtures of the CLI tests: a recording fake ctrl on loopback, a kibo.toml
pointing at it, and a runner with pinned ``COLUMNS`` and ASCII output."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cli_fakectrl import FakeCtrl, FakeCtrlServer
from cli_invoke import invoke
from click.testing import Result

CREDENTIAL = "kid-01k6testtesttesttesttesttes:s3cret"

Kibo = Callable[..., Result]


@pytest.fixture
def fake_ctrl() -> Iterator[FakeCtrl]:
    with FakeCtrlServer() as fake:
        yield fake


@pytest.fixture
def kibo_toml(tmp_path: Path, fake_ctrl: FakeCtrl) -> Path:
    path = tmp_path / "kibo.toml"
    path.write_text(f'ctrl_url = "{fake_ctrl.url}"\ncredential = "{CREDENTIAL}"\n'
                    'timeout = 10.0\n')
    return path


@pytest.fixture
def kibo(kibo_toml: Path) -> Kibo:
    """Run ``kibo ARGS`` against the fake ctrl."""

    def run(*args: str, input: str | None = None, env: dict[str, str] | None = None) -> Result:
        return invoke(kibo_toml, *args, input=input, env=env)

    return run
