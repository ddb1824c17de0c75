"""`kibotos.endpoints`: ``HOST:PORT`` read strictly, one canonical text."""

from __future__ import annotations

import pytest

from kibotos import endpoints


@pytest.mark.parametrize(("text", "default", "canonical"), [
    ("socks.example.com:1080", None, "socks.example.com:1080"),
    ("Socks.Example.COM:80", None, "socks.example.com:80"),
    ("10.0.0.1:1080", None, "10.0.0.1:1080"),
    ("[2001:DB8::1]:1080", None, "[2001:db8::1]:1080"),
    ("2001:db8::1", 53, "[2001:db8::1]:53"),
    ("8.8.8.8", 53, "8.8.8.8:53"),
    ("dns.example", 53, "dns.example:53"),
    ("1.1.1.1:5353", 53, "1.1.1.1:5353"),
    ("x:65535", None, "x:65535"),
])
def test_good_endpoints_are_canonical(text: str, default: int | None,
                                      canonical: str) -> None:
    assert endpoints.canonical(text, "address", default_port=default) == canonical


@pytest.mark.parametrize(("value", "needle"), [
    ("x", "has no port"), ("x:", "the port is empty"), ("x:0", "1-65535"),
    ("x:65536", "1-65535"), ("x:080", "leading zero"), ("x:+80", "ASCII digits"),
    ("x:٨٠", "ASCII digits"), ("1.2.3.256:1", "not an IP address"),
    ("1.2.3:1", "not an IP address"), ("a b:1", "white space"), (" x:1", "white space"),
    ("0.0.0.0:1", "unspecified or multicast"), ("[::]:1", "unspecified or multicast"),
    ("224.0.0.1:5", "unspecified or multicast"), ("2001:db8::1:80", "in brackets"),
    ("[2001:db8::1]", "has no port"), ("[1.2.3.4]:5", "brackets hold an IPv6"),
    ("[fe80::1%eth0]:1", "zone"), ("exa_mple.com:1", "host name"),
    ("ex..com:1", "host name"), ("-x.com:1", "host name"), ("é.com:1", "host name"),
    ("host.123:1", "end in digits only"), ("a" * 64 + ".com:1", "host name"), (1080, "string"),
])
def test_bad_endpoints_say_what_is_wrong(value: object, needle: str) -> None:
    with pytest.raises(ValueError, match=r"^--address: ") as info:
        endpoints.parse(value, "--address")
    assert needle in str(info.value)
