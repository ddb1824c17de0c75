"""The real node (``kibotos node serve``) as the shipped ``kibotos-node.service`` in a real
systemd (a user manager, usersystemd.py), against a stand-in ctrl on loopback
(tests/node/node_helpers.FakeCtrl), with ``[supervisor] backend = "systemd"``.

Spec "The node service" and issue 5 item 5: ``Type=notify`` — the start is not done
until the node's first control session is established (``READY=1``); the node passed
its startup checks (it is the unit's MainPID, in its cgroup, without leftovers) and
holds the owner lock (check-maintenance names that MainPID); its data-plane process is a
unit of its own in ``kibotos-dataplane.slice`` that keeps running when the node's unit
is stopped.  A drop-in replaces only ``ExecStart=`` (``/usr/bin/kibotos-node`` is not
installed here) and points the node at the user manager's bus.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import trio
from systemd_helpers import Raw, new_supervisor
from usersystemd import UserSystemd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "node"))
from node_helpers import FakeCtrl, free_port, store_identity, write_config

from kibotos.config import NodeConfig, load
from kibotos.testing.waiting import wait_until

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.systemd]

UNIT = "kibotos-node.service"
CONTRIB = Path(__file__).resolve().parents[2] / "contrib" / "systemd"
MANAGER = ("/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager")
DEADLINE = 180


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kns-", dir="/tmp"))  # short socket paths
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def install_unit(manager: UserSystemd, raw: Raw, toml: Path) -> None:
    units = manager.dir / ".config" / "systemd" / "user"
    (units / f"{UNIT}.d").mkdir(parents=True)
    (units / UNIT).write_text((CONTRIB / UNIT).read_text())
    (units / f"{UNIT}.d" / "test.conf").write_text(textwrap.dedent(f"""
        [Service]
        ExecStart=
        ExecStart={sys.executable} -m kibotos.cli.main node serve --config {toml}
        Environment=DBUS_SYSTEM_BUS_ADDRESS={manager.bus}
    """))
    raw.call(*MANAGER, "Reload")


#: The shared wait, with this file's deadline (a node unit starting in systemd).
wait = partial(wait_until, timeout=DEADLINE, interval=0.1)


def state(raw: Raw) -> str:
    return "inactive" if raw.unit_path(UNIT) is None else \
        str(raw.props(UNIT, "Unit")["ActiveState"])


async def test_the_node_is_ready_when_its_first_session_is_established(
        user_systemd: UserSystemd, raw: Raw, base: Path) -> None:
    port = free_port()
    extra = (f'[supervisor]\nbackend = "systemd"\n'
             f'[supervisor.systemd]\nbus = "{user_systemd.bus}"\n')
    toml = write_config(base, ctrl_url=f"http://127.0.0.1:{port}", extra=extra)
    toml.write_text(toml.read_text().replace("127.0.0.1:7500", f"127.0.0.1:{free_port()}"))
    config = load(NodeConfig, toml)
    store_identity(config)
    install_unit(user_systemd, raw, toml)
    sup = new_supervisor(user_systemd)
    try:
        raw.call(*MANAGER, "StartUnit", "ss", (UNIT, "replace"))
        # The node runs, but no ctrl answers yet: the start job is not done.
        await wait(lambda: raw.unit_path(UNIT) is not None and raw.props(UNIT)["MainPID"],
                   "the node process started")
        assert state(raw) == "activating"
        pid = raw.props(UNIT)["MainPID"]
        async with trio.open_nursery() as nursery:
            await nursery.start(FakeCtrl(port=port).serve)
            await wait(lambda: state(raw) == "active", "READY=1 after the first session")
            assert raw.props(UNIT)["MainPID"] == pid  # notified by the main process
            # It holds the owner lock: check-maintenance names its MainPID.
            check = await trio.run_process(
                [sys.executable, "-m", "kibotos.cli.main", "node", "check-maintenance",
                 "--config", str(toml), "--operation", "upgrade"],
                capture_stdout=True, capture_stderr=True, check=False)
            assert check.returncode == 13
            assert f"a node process (pid {pid}) holds the owner lock" in check.stdout.decode()
            # Its data-plane process is a unit of its own.
            planes = await wait(lambda: sup.list("kibotos-dataplane-"), "the data-plane unit")
            plane = planes[0]
            assert plane.active
            assert plane.cgroup is not None
            assert "/kibotos.slice/kibotos-dataplane.slice/" in plane.cgroup
            # systemctl stop: the node ends, its data-plane process does not.
            raw.call(*MANAGER, "StopUnit", "ss", (UNIT, "replace"))
            await wait(lambda: state(raw) in ("inactive", "failed"), "the node stopped")
            after = await sup.describe(plane.name)
            assert after is not None
            assert after.active
            assert after.main_pid == plane.main_pid
            nursery.cancel_scope.cancel()
    finally:
        if raw.unit_path(UNIT) is not None:
            raw.call(*MANAGER, "StopUnit", "ss", (UNIT, "replace"))
        for info in await sup.list("kibotos-dataplane-"):
            await sup.stop(info.name, timeout=20)
