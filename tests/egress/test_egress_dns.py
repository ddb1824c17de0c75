"""DNS on the egress side: the message codec, and host names resolved with the node's
resolver list in order (real UDP servers on loopback addresses of the test's own)."""

from __future__ import annotations

import contextlib
import random
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
import trio

from kibotos.core.errors import NotFound, Unavailable
from kibotos.egress import dns_wire
from kibotos.egress.upstream import NameResolver


def loopback() -> str:
    """A loopback address no other test is likely to use at the same time."""
    return f"127.{random.randint(1, 250)}.{random.randint(1, 250)}.{random.randint(2, 250)}"


class Responder:
    """A UDP DNS server on ``address:53``: `rcode`, and A/AAAA records of `records`."""

    def __init__(self, records: dict[str, list[str]], rcode: int = 0) -> None:
        self.address = loopback()
        self.records, self.rcode = records, rcode
        self.queries: list[str] = []
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((self.address, 53))
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._deadline = time.monotonic() + 120
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        with self.sock:
            while not self._stop.is_set() and time.monotonic() < self._deadline:
                try:
                    query, peer = self.sock.recvfrom(512)
                except TimeoutError:
                    continue
                self.sock.sendto(self.answer(query), peer)

    def answer(self, query: bytes) -> bytes:
        qid = struct.unpack("!H", query[:2])[0]
        labels, i = [], 12
        while query[i]:
            labels.append(query[i + 1:i + 1 + query[i]].decode())
            i += 1 + query[i]
        qtype = struct.unpack("!H", query[i + 1:i + 3])[0]
        name = ".".join(labels)
        self.queries.append(f"{name}/{qtype}")
        question = query[12:i + 5]
        found = [a for a in self.records.get(name, [])
                 if (":" in a) == (qtype == dns_wire.TYPE_AAAA)]
        answers = b"".join(
            b"\xc0\x0c" + struct.pack("!HHIH", qtype, 1, 30, 16 if ":" in a else 4)
            + socket.inet_pton(socket.AF_INET6 if ":" in a else socket.AF_INET, a)
            for a in found)
        return struct.pack("!HHHHHH", qid, 0x8180 | self.rcode, 1, len(found), 0, 0) + \
            question + answers

    def stop(self) -> None:
        self._stop.set()


@pytest.fixture
def responders() -> Iterator[list[Responder]]:
    made: list[Responder] = []
    yield made
    for r in made:
        r.stop()


def test_codec_round_trip():
    query = dns_wire.build_query("upstream.test", dns_wire.TYPE_A, 0x1234)
    assert dns_wire.message_id(query) == 0x1234
    assert dns_wire.is_query(query)
    assert dns_wire.framed(query)[:2] == struct.pack("!H", len(query))
    with pytest.raises(dns_wire.DnsFormatError):
        dns_wire.message_id(b"\x00")
    with pytest.raises(dns_wire.DnsFormatError, match="1-63 bytes"):
        dns_wire.encode_name("a" * 64 + ".test")


def test_answers_with_compressed_names_and_bad_ones():
    r = Responder.__new__(Responder)
    r.records, r.rcode, r.queries = {"up.test": ["198.18.1.2", "2001:2::9"]}, 0, []
    query = dns_wire.build_query("up.test", dns_wire.TYPE_AAAA, 7)
    answer = dns_wire.parse_answer(r.answer(query), 7, dns_wire.TYPE_AAAA)
    assert answer == dns_wire.Answer(rcode=0, addresses=("2001:2::9",), ttl=30)
    with pytest.raises(dns_wire.DnsFormatError, match="not the answer"):
        dns_wire.parse_answer(r.answer(query), 8, dns_wire.TYPE_AAAA)
    with pytest.raises(dns_wire.DnsFormatError, match="past the end"):
        dns_wire.parse_answer(r.answer(query)[:-5], 7, dns_wire.TYPE_AAAA)
    looping = struct.pack("!HHHHHH", 7, 0x8180, 1, 0, 0, 0) + b"\x01a" * 200
    with pytest.raises(dns_wire.DnsFormatError):
        dns_wire.parse_answer(looping, 7, dns_wire.TYPE_A)


async def test_names_are_resolved_by_the_first_resolver_that_answers(responders):
    failing = Responder({}, rcode=dns_wire.RCODE_SERVFAIL)
    good = Responder({"socks.test": ["127.0.0.1"], "dual.test": ["198.18.1.2", "2001:2::9"]})
    never = Responder({"socks.test": ["127.9.9.9"]})
    responders += [failing, good, never]
    silent = loopback()  # nothing listens: refused at once on loopback
    names = NameResolver([silent, failing.address, good.address, never.address],
                         timeout=2)
    with trio.fail_after(20):
        assert await names.addresses("socks.test") == ("127.0.0.1",)
        assert await names.addresses("dual.test") == ("198.18.1.2", "2001:2::9")
        assert never.queries == []
        asked = len(good.queries)
        assert await names.addresses("socks.test") == ("127.0.0.1",)  # from the cache
        assert len(good.queries) == asked
        assert await names.addresses("198.18.0.1") == ("198.18.0.1",)  # no lookup


async def test_a_name_that_does_not_exist_is_not_asked_again_elsewhere(responders):
    first = Responder({}, rcode=dns_wire.RCODE_NXDOMAIN)
    second = Responder({"gone.test": ["127.0.0.1"]})
    responders += [first, second]
    names = NameResolver([first.address, second.address], timeout=2)
    with trio.fail_after(20), pytest.raises(NotFound, match=r"gone\.test has no address"):
        await names.addresses("gone.test")
    assert second.queries == []


async def test_no_resolver_answering_is_unavailable_naming_each(responders):
    names = NameResolver([loopback(), loopback()], timeout=1)
    with trio.fail_after(20), pytest.raises(Unavailable, match="no resolver answered"):
        await names.addresses("socks.test")
    with pytest.raises(Unavailable, match="no \\[network\\] resolvers"):
        await NameResolver([]).addresses("socks.test")


async def test_open_tcp_connects_to_a_resolved_name(responders):
    good = Responder({"here.test": ["127.0.0.1"]})
    responders.append(good)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        with trio.fail_after(20):
            stream = await NameResolver([good.address]).open_tcp("here.test", port)
            async with stream:
                conn, _ = server.accept()
                with contextlib.closing(conn):
                    await stream.send_all(b"hi")
                    assert conn.recv(8) == b"hi"
