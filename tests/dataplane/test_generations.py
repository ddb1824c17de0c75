"""The spec's table as the node reads it (`kibotos.node.dataplane.generations.decide`),
row by row, and the check a new generation makes of the socket it is handed
(`kibotos.dataplane.process.listen_handover.check_listener`): only a listening TCP socket on
the configured address is ever served on."""

from __future__ import annotations

import socket

import pytest

from kibotos.core.errors import FailedPrecondition
from kibotos.dataplane.process.listen_handover import check_listener
from kibotos.node.dataplane.generations import ADOPT, HAND_OVER, REBIND, RESTART, decide

LISTEN = "127.0.0.1:7500"


def status(build: str, listen: str = LISTEN, *, handover: bool = True) -> dict[str, object]:
    return {"generation": 3, "build": build, "configured_listen": listen,
            "handover": handover}


@pytest.mark.parametrize(("running", "node_build", "action", "reason"), [
    (status("0.4.1+aaa"), "0.4.1+aaa", ADOPT, "the same build, listen address"),
    (status("0.4.1+aaa"), "0.4.3+bbb", HAND_OVER, "another build on the same release line"),
    (status("0.4.1+aaa", "127.0.0.1:7600"), "0.4.1+aaa", REBIND,
     "the listen address changed (127.0.0.1:7600 -> 127.0.0.1:7500)"),
    (status("0.4.1+aaa", "127.0.0.1:7600"), "0.4.3+bbb", REBIND,
     "the listen address changed"),
    (status("0.4.1+aaa"), "0.5.0+aaa", RESTART, "another release line"),
    (status("0.4.1+aaa", "127.0.0.1:7600"), "0.5.0+aaa", RESTART, "another release line"),
    (status("0.5.0a1+aaa"), "0.5.0a2+aaa", RESTART, "another release line"),
    (status("0.5.0a1+aaa"), "0.5.0+aaa", RESTART, "another release line"),
    (status("0.1.0.dev0+src.1"), "0.1.0.dev0+src.2", HAND_OVER, "same release line"),
    (status("0.4.1+aaa", handover=False), "0.4.3+bbb", RESTART,
     "cannot hand over its listening socket"),
    (status("0.4.1+aaa", handover=False), "0.4.1+aaa", ADOPT, "the same build"),
])
def test_the_spec_table_row_by_row(running: dict[str, object], node_build: str, action: str,
                                   reason: str) -> None:
    decision = decide(running, build=node_build, listen=LISTEN)
    assert decision.action == action
    assert reason in decision.reason


def test_changed_listener_settings_hand_over() -> None:
    running = {**status("0.4.1+aaa"), "tls": False}
    assert decide(running, build="0.4.1+aaa", listen=LISTEN,
                  settings={"tls": False}).action == ADOPT
    decision = decide(running, build="0.4.1+aaa", listen=LISTEN, settings={"tls": True})
    assert (decision.action, decision.reason) == (
        HAND_OVER, "the listener settings changed (tls False -> True)")
    assert decide(running, build="0.5.0+aaa", listen=LISTEN,
                  settings={"tls": True}).action == RESTART
    assert decide(running, build="0.4.1+aaa", listen="127.0.0.1:1",
                  settings={"tls": True}).action == REBIND


def test_only_a_listening_tcp_socket_on_the_configured_address_is_taken() -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        check_listener(listening, "127.0.0.1", port)
        check_listener(listening, "0.0.0.0", port)  # a wildcard host: by port
        with pytest.raises(FailedPrecondition, match="listens on port"):
            check_listener(listening, "127.0.0.1", port + 1)
        with pytest.raises(FailedPrecondition, match=r"not the configured 127\.0\.0\.2"):
            check_listener(listening, "127.0.0.2", port)
    with socket.socket() as bound_only:
        bound_only.bind(("127.0.0.1", 0))
        with pytest.raises(FailedPrecondition, match="not listening"):
            check_listener(bound_only, "127.0.0.1", bound_only.getsockname()[1])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.bind(("127.0.0.1", 0))
        with pytest.raises(FailedPrecondition, match="not a TCP socket"):
            check_listener(udp, "127.0.0.1", udp.getsockname()[1])
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix, \
            pytest.raises(FailedPrecondition, match="not a TCP socket"):
        check_listener(unix, "127.0.0.1", 1)
