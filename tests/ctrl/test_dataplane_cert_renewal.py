"""The node's data-plane certificate with a real ctrl over HTTPS and a real
``kibotos dataplane serve`` process, with a short certificate lifetime (spec:
node-and-vmm-processes, "Data-plane processes"): the node obtains a certificate for its
key and address with its own credential and supplies it; renewal replaces it without a
restart (a new handshake sees the new serial, an established exec keeps working); a
certificate that expired while the node was stopped fails new handshakes only; the node
renews on its return, with the key it made once."""

from __future__ import annotations

import datetime as dt
import logging
import os
import sys
from pathlib import Path

import pytest
import trio
from ctrl_helpers import RunningCtrl, enroll_node, update_node

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dataplane"))
from dp_harness import TIMEOUT, PlaneProcess, free_port, running_agent, target
from tls_harness import echo, handshake_error, handshake_serial

from kibotos.core.credentials import SigningKey
from kibotos.dataplane.clients.client import open_exec
from kibotos.dataplane.endpoints.exec_session import ExecRequest
from kibotos.dataplane.process.control import control_call
from kibotos.node.dataplane.certificate import (
    KEY_FILE,
    CertificateKeeper,
    CertificateTiming,
    CtrlIssuer,
)
from kibotos.tls.contexts import verification_error

FAST = CertificateTiming(check_interval=0.2, retry_initial=0.2, retry_cap=1.0)
#: Seconds: renewal at two thirds, so about every 5 s.
LIFETIME = 8.0


def shorten_lifetime(ctrl: RunningCtrl, seconds: float) -> None:
    """``[tls] dataplane_cert_lifetime`` below what an operator may set (60 s): the
    behaviours need certificates that end within the test."""
    config = ctrl.ctx.config
    ctrl.ctx.config = config.model_copy(update={
        "tls": config.tls.model_copy(update={"dataplane_cert_lifetime": seconds})})


async def served_serial(control: Path) -> str | None:
    status = await control_call(control, {"type": "status"}, timeout=TIMEOUT)
    serial = status["certificate_serial"]
    assert serial is None or isinstance(serial, str)
    return serial


async def until_served(keeper: CertificateKeeper, control: Path, *,
                       not_serial: str | None = None) -> str:
    """Until the data plane serves the keeper's certificate (another than
    `not_serial`); its serial."""
    with trio.fail_after(TIMEOUT):
        while True:
            serial = keeper.serial
            if serial is not None and serial != not_serial \
                    and await served_serial(control) == serial:
                return serial
            await trio.sleep(0.1)


async def test_renewal_expiry_while_stopped_and_renewal_on_return(
        running_ctrl: RunningCtrl, tmp_path: Path) -> None:
    ctrl = running_ctrl
    shorten_lifetime(ctrl, LIFETIME)
    credential = await enroll_node(ctrl.http, ctrl.operator, "node-a")
    dp = PlaneProcess(tmp_path, tls=True)
    await update_node(ctrl.ctx.store, "node-a", dataplane_address=f"https://{dp.listen}")
    state_dir = tmp_path / "node-state"

    def keeper() -> CertificateKeeper:
        return CertificateKeeper(state_dir=state_dir, control=dp.plane(SigningKey.generate()
                                                                       ).control,
                                 issue=CtrlIssuer(ctrl.url, lambda: credential, ctrl.tls),
                                 timing=FAST)

    try:
        await dp.wait_serving()
        plane = dp.plane(SigningKey.generate(), client_tls=ctrl.tls)
        with running_agent(tmp_path) as agent:
            await plane.hand_state(target(agent))
            # No certificate yet: the listener has nothing to offer.
            await handshake_error(plane.listen, ctrl.tls)
            async with trio.open_nursery() as node:
                first = keeper()
                await node.start(first.run)
                first.on_welcome()
                s1 = await until_served(first, plane.control)
                assert await handshake_serial(plane.listen, ctrl.tls) == s1
                async with open_exec(plane.url, plane.credential(), ExecRequest(("cat",)),
                                     ssl_context=ctrl.tls) as ex:
                    assert await echo(ex, b"before renewal\n") == b"before renewal\n"
                    s2 = await until_served(first, plane.control, not_serial=s1)
                    assert await handshake_serial(plane.listen, ctrl.tls) == s2
                    assert await echo(ex, b"after renewal\n") == b"after renewal\n"
                    # The node stops; its certificate runs out meanwhile.
                    node.cancel_scope.cancel()
                    assert first.cert is not None
                    with trio.fail_after(TIMEOUT):
                        while dt.datetime.now(dt.UTC) <= first.cert.not_valid_after_utc:
                            await trio.sleep(0.2)
                    failed = verification_error(await handshake_error(plane.listen,
                                                                      ctrl.tls))
                    assert failed is not None
                    assert "expired" in failed.verify_message
                    assert await echo(ex, b"while expired\n") == b"while expired\n"
                    # The node returns: same key, a new certificate, served at once.
                    async with trio.open_nursery() as again:
                        second = keeper()
                        await again.start(second.run)
                        assert second.serial == s2
                        assert second.due()
                        assert first.key is not None
                        assert second.key is not None
                        assert second.key.public_key() == first.key.public_key()
                        second.on_welcome()
                        s3 = await until_served(second, plane.control, not_serial=s2)
                        assert await handshake_serial(plane.listen, ctrl.tls) == s3
                        assert await echo(ex, b"back\n") == b"back\n"
                        again.cancel_scope.cancel()
                    await ex.close_stdin()
        assert os.stat(state_dir / KEY_FILE).st_mode & 0o777 == 0o600
    finally:
        dp.stop()


async def test_while_ctrl_is_away_the_node_retries_with_backoff(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from kibotos.tls.ca import ClusterCA
    from kibotos.tls.contexts import client_context

    caplog.set_level(logging.WARNING, logger="kibotos")
    away = CtrlIssuer(f"https://127.0.0.1:{free_port()}", lambda: "kcr-x",
                      client_context(ClusterCA.generate().cert_pem))
    keeper = CertificateKeeper(state_dir=tmp_path, control=tmp_path / "no.sock",
                               issue=away, timing=FAST)
    async with trio.open_nursery() as node:
        await node.start(keeper.run)
        keeper.on_welcome()
        with trio.fail_after(TIMEOUT):
            while caplog.text.count("data-plane certificate not renewed") < 3:
                await trio.sleep(0.1)
        node.cancel_scope.cancel()
    assert "cannot reach ctrl" in caplog.text
    assert keeper.cert is None
