"""The node's data-plane process (`kibotos.node.dataplane.supervisor`) with the
``systemd`` supervisor in a real systemd (a user manager, usersystemd.py): spec "Data-
plane processes" — a unit ``kibotos-dataplane-<scope>-<generation>.service`` in
``kibotos.slice/kibotos-dataplane.slice`` running ``kibotos dataplane serve`` as root,
serving exec with the state the node hands over; a restarted node adopts it (same
process, same generation); killed, the node starts the next generation; on another
build of the release line the next unit takes over the listening socket while the old
unit keeps its session.  The ``direct``
supervisor's version is tests/dataplane/test_supervisor.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from systemd_helpers import Raw, new_supervisor
from usersystemd import UserSystemd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dataplane"))
from dp_harness import TIMEOUT, Plane, free_port, run_exec, running, running_agent, target

from kibotos._version import __version__
from kibotos.core.credentials import SigningKey
from kibotos.dataplane.clients.client import Output, Started, open_exec
from kibotos.dataplane.endpoints.exec_session import ExecRequest
from kibotos.node.dataplane import supervisor as dps
from kibotos.node.dataplane.supervisor import (
    DataplaneSupervisor,
    DataplaneTiming,
    unit_name,
)

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.systemd]

FAST = DataplaneTiming(watch_interval=0.2, restart_initial=0.2, restart_cap=1.0,
                       metrics_interval=0.5)


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kdps-", dir="/tmp"))  # short socket paths
    (path / "state").mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def test_the_dataplane_unit_serves_is_adopted_and_replaced(
        user_systemd: UserSystemd, raw: Raw, base: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    listen = f"127.0.0.1:{free_port()}"
    key = SigningKey.generate()

    def dataplane() -> DataplaneSupervisor:
        return DataplaneSupervisor(node_id="node-a", listen=listen,
                                   socket_dir=base / "run", state_dir=base / "state",
                                   supervisor=new_supervisor(user_systemd), timing=FAST,
                                   tls=False)

    sup = new_supervisor(user_systemd)
    try:
        with running_agent(base) as agent:
            async with running(dataplane()) as first:
                assert await first.set_public_key(key.public_key)
                assert await first.set_target(target(agent))
                name = unit_name(first.scope, 1) + ".service"
                service = raw.props(name)
                assert service["ControlGroup"].endswith(
                    f"/kibotos.slice/kibotos-dataplane.slice/{name}")
                assert (service["Restart"], service["KillMode"], service["User"]) == (
                    "no", "control-group", "")
                # What `systemctl list-units 'kibotos-dataplane-*'` asks systemd.
                (listed,) = raw.call("/org/freedesktop/systemd1",
                                     "org.freedesktop.systemd1.Manager",
                                     "ListUnitsByPatterns", "asas",
                                     ([], ["kibotos-dataplane-*"]))
                assert [u[0] for u in listed] == [name]
                plane = Plane(base / "run", 1, key, listen)
                result = await run_exec(plane, ["echo", "through systemd"])
                assert result.stdout == b"through systemd\n"
                pid = service["MainPID"]
            # The node process ended: the unit did not.
            assert raw.props(name)["MainPID"] == pid
            assert (await run_exec(plane, ["echo", "alone"])).stdout == b"alone\n"
            restarted = dataplane()
            restarted.preload([target(agent)])  # the Instances the node reloaded
            async with running(restarted) as second:
                assert (second.generation, second.starts, second.adopted) == (1, 0, 1)
                os.kill(pid, signal.SIGKILL)
                with trio.fail_after(TIMEOUT):
                    while second.generation != 2 or not second.confirmed:
                        await trio.sleep(0.05)
                assert (base / "state" / "dataplane-generation").read_text() == "2\n"
                again = Plane(base / "run", 2, key, listen)
                assert (await run_exec(again, ["echo", "again"])).stdout == b"again\n"
                assert raw.unit_path(unit_name(second.scope, 2) + ".service") is not None
            # Another build of the release line: generation 3's unit takes over the
            # listening socket; generation 2's unit keeps the session it holds.
            with trio.fail_after(TIMEOUT):
                async with open_exec(again.url, again.credential(),
                                     ExecRequest(("cat",))) as ex:
                    assert isinstance(await ex.next_event(), Started)
                    monkeypatch.setattr(dps, "source_build_id",
                                        lambda: f"{__version__}+build-b")
                    upgraded = dataplane()
                    upgraded.preload([target(agent)])
                    async with running(upgraded) as third:
                        assert (third.generation, third.waiting) == (3, 2)
                    assert (await run_exec(again, ["echo", "on 3"])).stdout == b"on 3\n"
                    await ex.send_stdin(b"kept\n")
                    event = await ex.next_event()
                    assert isinstance(event, Output)
                    assert event.data == b"kept\n"
                    waiting = await sup.describe(unit_name(third.scope, 2))
                    assert waiting is not None
                    assert waiting.active
    finally:
        for info in await sup.list("kibotos-dataplane-"):
            await sup.stop(info.name, timeout=15)
