"""The node verifies ctrl (a real ctrl serving HTTPS from its cluster CA, on loopback):
with another CA in ``[node] ctrl_ca_file`` enrollment stops at once without sending
the grant and the control session is refused slowly, naming the file; with ctrl's CA
the same grant enrolls and the session is established over wss://."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import trio
from ctrl_api_harness import ctrl_grant
from node_helpers import RecordingInstances, ctrl_endpoint, free_port, node_config

from kibotos.config import CtrlConfig, NodeConfig, load
from kibotos.core.errors import FailedPrecondition
from kibotos.ctrl.serve import serve_ctrl
from kibotos.node.host.clock import NodeClock
from kibotos.node.host.usage import UsageSampler
from kibotos.node.session.control import ControlSession, SessionTiming
from kibotos.node.session.identity import NodeIdentity, enroll
from kibotos.node.session.report import ReportBoard
from kibotos.tls.ca import ClusterCA

TIMING = SessionTiming(ping_interval=0.5, backoff_initial=0.05, backoff_cap=0.2,
                       slow_retry=60.0)


def session(config: NodeConfig, identity: NodeIdentity) -> ControlSession:
    manager = RecordingInstances()
    sampler = UsageSampler(config.host.proc_root, manager)
    return ControlSession(config, identity, 1, clock=NodeClock(None), sampler=sampler,
                          board=ReportBoard(manager, sampler.tightness), instances=manager,
                          timing=TIMING, ssl_context=config.node.ctrl_tls())


async def test_node_verifies_ctrl_before_sending_anything(tmp_path: Path) -> None:
    ctrl_toml = tmp_path / "ctrl.toml"
    ctrl_toml.write_text(f'[ctrl]\nlisten = "127.0.0.1:{free_port()}"\n'
                         f'state_dir = "{tmp_path / "ctrl"}"\nreconcile_interval = "1h"\n')
    ctrl = ctrl_endpoint(ctrl_toml)
    stranger = tmp_path / "stranger-ca.crt"
    stranger.write_bytes(ClusterCA.generate().cert_pem)
    for side in ("wrong", "right"):
        (tmp_path / side).mkdir()
    grant_file = tmp_path / "grant"
    wrong = node_config(tmp_path / "wrong", ctrl_url=ctrl.url, ctrl_ca_file=stranger,
                        grant_file=grant_file)
    right = node_config(tmp_path / "right", ctrl_url=ctrl.url, ctrl_ca_file=ctrl.ca_file,
                        grant_file=grant_file)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(serve_ctrl, load(CtrlConfig, ctrl_toml),
                                        handle_signals=False))
            grant_file.write_text(await ctrl_grant(ctrl_toml, "--kind", "node",
                                                   "--node-id", "node-a") + "\n")
            with pytest.raises(FailedPrecondition,
                               match=r"does not verify against node\.ctrl_ca_file"):
                await enroll(wrong, tmp_path / "wrong-identity.json")
            assert not (tmp_path / "wrong-identity.json").exists()
            identity = await enroll(right, tmp_path / "identity.json")  # the grant is unused

            refused = session(wrong, identity)
            async with trio.open_nursery() as inner:
                inner.start_soon(refused.run)
                await refused.status.wait_until(lambda s: s.last_refusal is not None)
                inner.cancel_scope.cancel()
            assert refused.status.last_refusal is not None
            assert "does not verify against node.ctrl_ca_file" in refused.status.last_refusal
            assert refused.status.established == 0

            accepted = session(right, identity)
            assert accepted.url.startswith("wss://")
            async with trio.open_nursery() as inner:
                inner.start_soon(accepted.run)
                await accepted.status.wait_until(lambda s: s.connected)
                inner.cancel_scope.cancel()
            nursery.cancel_scope.cancel()
