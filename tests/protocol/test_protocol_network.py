"""The network policy on the wire (`kibotos.protocol.commands.network`): CIDRs checked
and canonical, strict types, bounded lists, the resolver-via-egress rule."""

from __future__ import annotations

import pytest

from kibotos.core.errors import InvalidArgument
from kibotos.protocol import CreateSpec, NetworkPolicy, SetNetworkArgs, parse_args


def test_a_default_policy_is_public_egress_with_no_lists() -> None:
    policy = NetworkPolicy()
    assert (policy.public_egress, policy.allow_out, policy.deny_out) == (True, [], [])
    assert policy.egress is None
    assert policy.resolver is None


def test_cidrs_are_kept_canonical() -> None:
    policy = NetworkPolicy.model_validate(
        {"allow_out": ["198.18.0.10", "2001:db8::1"], "deny_out": ["0.0.0.0/0", "::/0"]})
    assert policy.allow_out == ["198.18.0.10/32", "2001:db8::1/128"]
    assert policy.deny_out == ["0.0.0.0/0", "::/0"]


@pytest.mark.parametrize(("body", "needle"), [
    ({"allow_out": ["10.0.0.1/8"]}, "host bits set"),
    ({"deny_out": ["example.org"]}, "is not an IP address or a CIDR"),
    ({"deny_out": [3]}, "string"),
    ({"public_egress": "yes"}, "boolean"),
    ({"public_egress": 1}, "boolean"),
    ({"allow_out": ["10.0.0.0/8"] * 513}, "at most 512"),
    ({"resolver": {"name": "corp", "revision": 1, "upstream": "10.0.0.53",
                   "via_egress": True}}, "needs the policy's egress"),
    ({"egress": {"name": "corp", "revision": 0, "address": "proxy:1080"}}, "greater than"),
    ({"wat": 1}, "wat"),
])
def test_bad_policies_name_what_is_wrong(body: dict[str, object], needle: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_args(SetNetworkArgs, {"instance_id": "i-1", "revision": 2, "network": body})
    assert needle in info.value.message


def test_create_without_network_gives_no_network() -> None:
    spec = {"instance_id": "i-1", "workspace_id": "w-1",
            "template": {"name": "t", "image_digest": "a" * 64, "kernel_digest": "b" * 64,
                         "initramfs_digest": "c" * 64},
            "cpu_millis": 1000, "memory_bytes": 256 << 20,
            "layer": {"pool_id": "p", "ref": "l-1", "capacity_bytes": 64 << 20, "epoch": 1}}
    assert parse_args(CreateSpec, spec).network is None
    with_net = parse_args(CreateSpec, {**spec, "network": {"deny_out": ["0.0.0.0/0"]},
                                       "network_revision": 1})
    assert with_net.network is not None
    assert with_net.network.deny_out == ["0.0.0.0/0"]
