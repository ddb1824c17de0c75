"""TLS on the data-plane listener (a data plane in this process, the real guest agent):
no certificate → every handshake fails; the node's certificate serves exec over wss
verified against the cluster CA; a new certificate reaches new handshakes while an
established connection keeps working; an expired one fails new handshakes and leaves
established connections alone; a bad pair is refused and the one in use stays."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
import trio
from dp_harness import TIMEOUT, in_process_plane, run_exec, running_agent, target
from tls_harness import TestCA, echo, handshake_error, handshake_serial, serial_of, supply

from kibotos.core.errors import InvalidArgument, Unavailable
from kibotos.dataplane.clients.client import open_exec
from kibotos.dataplane.endpoints.exec_session import ExecRequest
from kibotos.dataplane.process.control import control_call
from kibotos.tls.contexts import verification_error


async def test_no_certificate_fails_handshakes_and_the_supplied_one_serves_exec(
        tmp_path: Path) -> None:
    ca = TestCA()
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path, client_tls=ca.client) as plane:
            status = await control_call(plane.control, {"type": "status"})
            assert (status["tls"], status["certificate_serial"]) == (True, None)
            await handshake_error(plane.listen, ca.client)
            from kibotos.dataplane.clients.files_client import FilesClient
            with pytest.raises(Unavailable, match=r"TLS handshake .* failed: .*no "
                                                  r"certificate yet"):
                await FilesClient(plane.url, plane.credential(operations=("files",)),
                                  ssl_context=ca.client).stat("/")
            await plane.hand_state(target(agent))
            cert, key = ca.pair()
            answer = await supply(plane.control, cert, key)
            assert answer["certificate_serial"] == serial_of(cert)
            assert await handshake_serial(plane.listen, ca.client) == serial_of(cert)
            result = await run_exec(plane, ["echo", "over tls"])
            assert (result.stdout, result.status.exit_code) == (b"over tls\n", 0)
            # A client that trusts another CA refuses it: nothing skips verification.
            other = TestCA()
            assert verification_error(await handshake_error(plane.listen, other.client))


async def test_renewal_reaches_new_handshakes_and_established_connections_go_on(
        tmp_path: Path) -> None:
    ca = TestCA()
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path, client_tls=ca.client) as plane:
            await plane.hand_state(target(agent))
            first = ca.pair()
            await supply(plane.control, *first)
            async with open_exec(plane.url, plane.credential(), ExecRequest(("cat",)),
                                 ssl_context=ca.client) as ex:
                assert await echo(ex, b"before\n") == b"before\n"
                second = ca.pair()
                await supply(plane.control, *second)
                assert await handshake_serial(plane.listen, ca.client) == serial_of(
                    second[0]) != serial_of(first[0])
                assert await echo(ex, b"after\n") == b"after\n"
                await ex.close_stdin()


async def test_an_expired_certificate_fails_new_handshakes_only(tmp_path: Path) -> None:
    ca = TestCA()
    with running_agent(tmp_path) as agent:
        async with in_process_plane(tmp_path, client_tls=ca.client) as plane:
            await plane.hand_state(target(agent))
            cert, key = ca.pair(lifetime=2.0)
            await supply(plane.control, cert, key)
            async with open_exec(plane.url, plane.credential(), ExecRequest(("cat",)),
                                 ssl_context=ca.client) as ex:
                assert await echo(ex, b"one\n") == b"one\n"
                end = (await control_call(plane.control, {"type": "status"})
                       )["certificate_not_after"]
                with trio.fail_after(TIMEOUT):  # the node is "away": nothing renews
                    while dt.datetime.now(dt.UTC) <= dt.datetime.fromisoformat(end):
                        await trio.sleep(0.2)
                failed = verification_error(await handshake_error(plane.listen, ca.client))
                assert failed is not None
                assert "expired" in failed.verify_message
                assert await echo(ex, b"two\n") == b"two\n"
                # The node is back: its new certificate serves new handshakes again.
                renewed = ca.pair()
                await supply(plane.control, *renewed)
                assert await handshake_serial(plane.listen, ca.client) == serial_of(
                    renewed[0])
                await ex.close_stdin()


async def test_a_bad_pair_is_refused_and_the_certificate_in_use_stays(
        tmp_path: Path) -> None:
    ca = TestCA()
    async with in_process_plane(tmp_path, client_tls=ca.client) as plane:
        cert, key = ca.pair()
        await supply(plane.control, cert, key)
        _, other_key = ca.pair()
        for bad, why in [((cert, other_key), "do not load together"),
                         (("not pem", key), "not a PEM certificate"),
                         ((cert, ""), "'key' must be PEM text")]:
            with pytest.raises(InvalidArgument, match=why):
                await supply(plane.control, *bad)
        assert await handshake_serial(plane.listen, ca.client) == serial_of(cert)
        assert (await control_call(plane.control, {"type": "status"})
                )["certificate_serial"] == serial_of(cert)


async def test_a_plain_data_plane_takes_no_certificate(tmp_path: Path) -> None:
    ca = TestCA()
    async with in_process_plane(tmp_path) as plane:
        assert (await control_call(plane.control, {"type": "status"}))["tls"] is False
        with pytest.raises(InvalidArgument, match="serves plain HTTP"):
            await supply(plane.control, *ca.pair())


@pytest.mark.parametrize(("listen", "tls", "reported"), [
    ("127.0.0.1:7500", True, "https://127.0.0.1:7500"),
    ("127.0.0.1:7500", False, "127.0.0.1:7500"),
    ("[::1]:7500", False, "[::1]:7500"),
    ("10.0.0.7:7500", True, "https://10.0.0.7:7500")])
def test_the_node_reports_its_data_plane_address_with_the_scheme(
        listen: str, tls: bool, reported: str) -> None:
    from kibotos.config import NodeSection
    section = NodeSection.model_validate({"id": "node-a", "ctrl_url": "https://ctrl:7400",
                                          "dataplane_listen": listen, "dataplane_tls": tls})
    assert section.dataplane_address() == reported


@pytest.mark.parametrize("value", ["no", 0, "false"])
def test_plain_is_only_for_loopback_and_only_a_boolean_says_so(value: object) -> None:
    from kibotos.config import NodeConfig, parse
    base = {"id": "node-a", "ctrl_url": "https://ctrl:7400"}
    with pytest.raises(InvalidArgument, match="only on a loopback dataplane_listen"):
        parse(NodeConfig, {"node": {**base, "dataplane_listen": "10.0.0.7:7500",
                                    "dataplane_tls": False}}, "node.toml")
    with pytest.raises(InvalidArgument, match="dataplane_tls"):
        parse(NodeConfig, {"node": {**base, "dataplane_tls": value}}, "node.toml")


async def test_every_client_reports_a_certificate_that_does_not_verify(
        tmp_path: Path) -> None:
    """exec (both clients), ports and files: `FailedPrecondition` naming the cluster CA,
    not a wait for an answer that never comes."""
    from kibotos.core.errors import FailedPrecondition
    from kibotos.dataplane.clients import exec_blocking
    from kibotos.dataplane.clients.files_client import FilesClient
    from kibotos.dataplane.clients.ports_client import open_port

    ca, other = TestCA(), TestCA()
    async with in_process_plane(tmp_path, client_tls=ca.client) as plane:
        await supply(plane.control, *ca.pair())

        async def exec_async() -> None:
            async with open_exec(plane.url, plane.credential(), ExecRequest(("true",)),
                                 ssl_context=other.client):
                pass

        async def ports() -> None:
            async with open_port(plane.url, plane.credential(operations=("ports",)), 80,
                                 ssl_context=other.client):
                pass

        async def files() -> None:
            await FilesClient(plane.url, plane.credential(operations=("files",)),
                              ssl_context=other.client).stat("/")

        async def exec_blocking_client() -> None:
            await trio.to_thread.run_sync(lambda: exec_blocking.connect(
                plane.url, plane.credential(), ExecRequest(("true",)),
                ssl_context=other.client))

        for client in (exec_async, ports, files, exec_blocking_client):
            with pytest.raises(FailedPrecondition, match=r"does not verify .*cluster_ca"):
                await client()
