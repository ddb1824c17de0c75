"""Fixtures of the network tests: root and ``nft`` (else a skip, or a failure under
``CI=true``, where `.ci/run` installs packaging/apt-test-deps.txt), the namespaces of
`netbed.World`, and a configured node network in its host namespace.
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
from collections.abc import Iterator

import pytest
from netbed import SCOPE, World, network_config

from kibotos.node.network import host_table

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _require_tools() -> None:
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    missing = [t for t in ("nft", "ip") if shutil.which(t, path=path) is None]
    if os.geteuid() != 0:
        missing.append("root (network namespaces)")
    if not os.path.exists("/dev/net/tun"):
        missing.append("/dev/net/tun")
    if ctypes.util.find_library("nftables") is None:
        missing.append("libnftables1")
    if missing:
        msg = f"the network tests need {', '.join(missing)} (packaging/apt-test-deps.txt)"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture
def net_tools() -> None:
    _require_tools()


@pytest.fixture
def world(net_tools: None) -> Iterator[World]:
    bed = World()
    try:
        host_table.prepare_host(network_config(), SCOPE, host_netns=bed.host)
        yield bed
    finally:
        bed.close()
