"""The handover with TLS on: the new generation takes the listening socket and the
node's last certificate with it, so every new handshake through the node's restart
gets the certificate, and an established TLS session on the old generation goes on."""

from __future__ import annotations

import pytest
import trio
from dp_harness import Node, hand_over, run_exec, running, running_agent, target
from tls_harness import TestCA, echo, handshake_serial, serial_of, supply

from kibotos._version import __version__
from kibotos.dataplane.clients.client import Started, open_exec
from kibotos.dataplane.endpoints.exec_session import ExecRequest
from kibotos.node.dataplane import supervisor as dps


async def test_a_tls_data_plane_hands_over_its_certificate_with_the_socket(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    ca = TestCA()
    cert, key = ca.pair()
    with running_agent(node.base) as agent:
        async with running(node.dataplane(tls=True)) as first:
            await hand_over(node, first, agent)
            await supply(first.control, cert, key)
        plane = node.plane(first)
        plane.client_tls = ca.client
        serials: list[str] = []
        failures: list[BaseException] = []

        async def probe(stop: trio.Event) -> None:
            while not stop.is_set():
                try:
                    serials.append(await handshake_serial(node.listen, ca.client))
                except Exception as exc:
                    failures.append(exc)
                await trio.sleep(0.01)

        with trio.fail_after(60):
            async with open_exec(plane.url, plane.credential(), ExecRequest(("cat",)),
                                 ssl_context=ca.client) as ex:
                assert isinstance(await ex.next_event(), Started)
                monkeypatch.setattr(dps, "source_build_id", lambda: f"{__version__}+tls-b")
                stop = trio.Event()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(probe, stop)
                    second = node.dataplane(tls=True)
                    second.preload([target(agent)])
                    async with running(second):
                        assert (second.generation, second.waiting) == (2, 1)
                        await trio.sleep(0.3)
                    stop.set()
                assert failures == []
                assert serials
                assert set(serials) == {serial_of(cert)}
                assert await echo(ex, b"kept\n") == b"kept\n"
                plane.generation = 2
                assert (await run_exec(plane, ["echo", "new"])).stdout == b"new\n"
                await ex.close_stdin()
