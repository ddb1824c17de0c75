"""Fixtures of the Firecracker tests: a jail-ready tree (`fc_env`) in a short directory,
with the fake jailer and the stand-in Firecracker behind the backend's options."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fc_harness import FcEnv, short_dir


@pytest.fixture
def fc_env() -> Iterator[FcEnv]:
    with short_dir() as root:
        yield FcEnv(root)
