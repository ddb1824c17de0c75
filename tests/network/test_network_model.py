"""The parts of node networking that need no privilege: ``[network]`` validation (errors
that name the key), policies, slots and their records, names, the generated table, and
the reader's classification on listings written out by hand."""

from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path

import pytest

from kibotos import config as kconfig
from kibotos.core.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kibotos.network_config import NetworkSection
from kibotos.node.network import slot_table
from kibotos.node.network.names import NetworkNames
from kibotos.node.network.policy import (
    NetworkPolicy,
    allowed,
    parse_policy,
    to_record,
    why_no_egress_process,
    why_not_enforceable,
)
from kibotos.node.network.records import NetworkRecords
from kibotos.node.network.slots import lowest_free, slot_addresses
from kibotos.node.network.table_check import compare, set_contents

SCOPE = "0badcafe"
BASE = {"ipv4_pool": "10.200.0.0/24", "ipv6_pool": "fd00:6b69::/120",
        "management_cidrs": ["10.99.0.0/24"], "uplink": "eth0", "public_egress": True,
        "resolvers": ["192.0.2.53"]}


NODE = {"node": {"id": "node-a", "ctrl_url": "http://127.0.0.1:7400"},
        "storage": {"root": "/var/lib/kibotos/node"},
        "resources": {"cpu": 2, "memory": "4G"}}


def section(**changes: object) -> NetworkSection:
    return NetworkSection.model_validate({**BASE, **changes})


def config_error(**changes: object) -> str:
    with pytest.raises(InvalidArgument) as err:
        kconfig.parse(kconfig.NodeConfig, {**NODE, "network": {**BASE, **changes}},
                      "node.toml")
    return err.value.message


# ---------------------------------------------------------------------------- [network]


def test_no_section_means_no_network(tmp_path: Path):
    assert kconfig.parse(kconfig.NodeConfig, NODE, "node.toml").network is None
    toml = tmp_path / "node.toml"
    toml.write_text('[node]\nid = "node-a"\nctrl_url = "http://127.0.0.1:7400"\n'
                    '[storage]\nroot = "/srv/kibotos"\n[resources]\ncpu = 2\n'
                    'memory = "4G"\n[network]\nipv4_pool = "10.200.0.0/16"\n'
                    'uplink = "eth0"\npublic_egress = true\nresolvers = ["192.0.2.53"]\n')
    network = kconfig.load(kconfig.NodeConfig, toml).network
    assert network is not None
    assert (network.slot_count, network.public_egress) == (16384, True)


def test_a_valid_section_and_its_parsed_views():
    net = section()
    assert net.pool4 == ipaddress.IPv4Network("10.200.0.0/24")
    assert net.slot_count == 64  # 256 / 4, and the /120 holds as many
    assert section(ipv6_pool="fd00:6b69::/124").slot_count == 4
    assert section(ipv6_pool=None).slot_count == 64
    assert net.uplink_address is None
    assert section(uplink="198.18.0.2").uplink_address == ipaddress.ip_address("198.18.0.2")


@pytest.mark.parametrize(("changes", "message"), [
    ({"ipv4_pool": "10.200.0.1/24"}, "network.ipv4_pool: '10.200.0.1/24' has host bits set"),
    ({"ipv4_pool": "fd00::/64"}, "network.ipv4_pool: 'fd00::/64' is not an IPv4 network"),
    ({"ipv4_pool": "10.200.0.0/31"}, "network.ipv4_pool: '10.200.0.0/31' holds no slot"),
    ({"ipv4_pool": "169.254.0.0/16"}, "overlaps the reserved range 169.254.0.0/16"),
    ({"ipv4_pool": ["10.0.0.0/8"]}, "network.ipv4_pool: Input should be a valid string"),
    ({"ipv6_pool": "fd00::1/64"}, "network.ipv6_pool: 'fd00::1/64' has host bits set"),
    ({"management_cidrs": ["10.99.0.0/24", "bad"]},
     "network.management_cidrs: management_cidrs[1]: 'bad' is not an IP address or a CIDR"),
    ({"management_cidrs": "10.99.0.0/24"}, "network.management_cidrs: Input should be a "
                                           "valid list"),
    ({"public_egress": "yes"}, "network.public_egress: Input should be a valid boolean"),
    ({"public_egress": 1}, "network.public_egress: Input should be a valid boolean"),
    ({"uplink": "no such/interface"}, "network.uplink: 'no such/interface' is neither"),
    ({"uplink": "127.0.0.1"}, "network.uplink: '127.0.0.1' cannot carry public egress"),
    ({"uplink": ""}, "public_egress = true needs an uplink"),
    ({"resolvers": ["127.0.0.53"]}, "network.resolvers: resolvers[0]: '127.0.0.53' is not "
                                    "reachable from a guest's network namespace"),
    ({"resolvers": ["192.0.2.53", "192.0.2.53"]}, "a resolver is listed twice"),
    ({"resolvers": ["192.0.2.0/24"]}, "'192.0.2.0/24' is not an IP address"),
    ({"management_cidrs": ["10.0.0.0/8"]}, "the pool 10.200.0.0/24 overlaps "
                                           "management_cidrs entry 10.0.0.0/8"),
    ({"uplinks": "eth0"}, "network.uplinks: unknown key"),
])
def test_a_bad_value_is_an_error_that_names_the_key(changes, message):
    assert message in config_error(**changes)


# ---------------------------------------------------------------------------- policy


def test_a_policy_is_strict_and_canonical():
    policy = parse_policy({"allow_out": ["198.18.1.1", "2001:2::/64"], "deny_out": []})
    assert policy.allow_out == ["198.18.1.1/32", "2001:2::/64"]
    assert [str(n) for n in allowed(policy, 4)] == ["198.18.1.1/32"]
    assert [str(n) for n in allowed(policy, 6)] == ["2001:2::/64"]
    assert parse_policy({}) == NetworkPolicy()  # public egress, nothing listed
    with pytest.raises(InvalidArgument, match=r"allow_out.0: '10.0.0.1/8' has host "
                                              r"bits set \(did you mean 10.0.0.0/8 or "
                                              r"10.0.0.1/32\?\)"):
        parse_policy({"allow_out": ["10.0.0.1/8"]})
    with pytest.raises(InvalidArgument, match="public_egress: Input should be a valid boolean"):
        parse_policy({"public_egress": "true"})
    with pytest.raises(InvalidArgument, match="proxy: unknown field"):
        parse_policy({"proxy": "socks.test:1080"})
    with pytest.raises(InvalidArgument, match="egress: Input should be"):
        parse_policy({"egress": "proxy"})
    with pytest.raises(InvalidArgument, match="a resolver via the egress needs the policy's "
                                              "egress"):
        parse_policy({"resolver": {"name": "r", "revision": 1, "upstream": "192.0.2.9",
                                   "via_egress": True}})
    # a policy without them is recorded as before they existed
    assert set(to_record(NetworkPolicy())) == {"public_egress", "allow_out", "deny_out"}
    referencing = parse_policy({"egress": {"name": "corp", "revision": 3,
                                           "address": "socks.test:1080"}})
    assert parse_policy(to_record(referencing)) == referencing


def test_what_this_node_cannot_enforce():
    assert why_not_enforceable(to_record(NetworkPolicy()), section()) is None
    assert "no longer provides" in str(why_not_enforceable(
        to_record(NetworkPolicy()), section(public_egress=False)))
    assert why_not_enforceable(to_record(NetworkPolicy(public_egress=False)),
                               section(public_egress=False)) is None
    assert "cannot read" in str(why_not_enforceable({"resolver": "r1"}, section()))
    # the table steers an Egress or a Resolver to the egress process (fail closed when
    # none listens); the node's admission refuses them while it runs none for its
    # Instances (an Instance manager run without them): refused, never sent direct
    egress = {"name": "corp", "revision": 1, "address": "proxy.test:1080"}
    resolver = {"name": "dns", "revision": 1, "upstream": "198.18.0.1"}
    assert why_not_enforceable({"egress": egress}, section()) is None
    assert why_not_enforceable({"resolver": resolver}, section()) is None
    for served in (True, False):
        assert why_no_egress_process(NetworkPolicy(), served=served) is None
    assert "Egress corp" in str(why_no_egress_process(parse_policy({"egress": egress}),
                                                      served=False))
    assert "no egress process" in str(why_no_egress_process(
        parse_policy({"resolver": resolver}), served=False))
    for policy in ({"egress": egress}, {"resolver": resolver}):
        assert why_no_egress_process(parse_policy(policy), served=True) is None


# ---------------------------------------------------------------------------- slots


def test_a_slot_is_four_addresses_of_each_pool():
    slot = slot_addresses(section(), 2)
    assert [str(a) for a in (slot.v4.host, slot.v4.ns, slot.v4.gateway, slot.v4.guest)] == [
        "10.200.0.8", "10.200.0.9", "10.200.0.10", "10.200.0.11"]
    assert slot.v6 is not None
    assert str(slot.v6.guest) == "fd00:6b69::b"
    assert (slot.v4.prefix, slot.v6.prefix) == (31, 127)
    with pytest.raises(InvalidArgument, match="outside the pools"):
        slot_addresses(section(), 64)


def test_the_lowest_free_slot_and_a_full_pool():
    assert lowest_free([], 4) == 0
    assert lowest_free([0, 1, 3], 4) == 2
    with pytest.raises(ResourceExhausted, match="every one of the 2 network slots"):
        lowest_free([0, 1], 2)


def test_records_hand_out_each_slot_once_and_a_retry_gets_the_same(tmp_path: Path):
    records, net = NetworkRecords(tmp_path / "network"), section()
    a = records.allocate("inst-a", SCOPE, net, NetworkPolicy(), ["198.18.0.2"])
    b = records.allocate("inst-b", SCOPE, net, NetworkPolicy(), ["198.18.0.2"])
    assert (a.slot.index, b.slot.index) == (0, 1)
    assert records.allocate("inst-a", SCOPE, net, NetworkPolicy(deny_out=["0.0.0.0/0"]),
                            []) == a  # a retry: the record on disk, whatever is asked
    records.remove("inst-a")
    assert records.allocate("inst-c", SCOPE, net, NetworkPolicy(), []).slot.index == 0
    assert [r.instance_id for r in records.all()] == ["inst-b", "inst-c"]
    path = records.path("inst-b")
    assert path.stat().st_mode & 0o777 == 0o600
    on_disk = json.loads(path.read_text())
    assert on_disk["names"]["netns"] == f"kibotos-{SCOPE}-inst-b"
    assert on_disk["facts"]["uplink_addresses"] == ["198.18.0.2"]
    assert records.read("inst-b") == b


def test_a_damaged_or_foreign_record_is_refused_by_name(tmp_path: Path):
    records = NetworkRecords(tmp_path)
    records.path("inst-x").write_text('{"format": 2}')
    with pytest.raises(FailedPrecondition, match=r"inst-x.json has format 2"):
        records.read("inst-x")
    records.path("inst-x").write_text('{"format": 1, "instance_id": "inst-x"}')
    with pytest.raises(FailedPrecondition, match="malformed network record"):
        records.read("inst-x")
    with pytest.raises(InvalidArgument, match="invalid network scope"):
        records.allocate("inst-y", "nothex!!", section(), NetworkPolicy(), [])
    assert not records.path("inst-y").exists()


def test_the_names_come_from_the_scope_and_the_instance_id_alone():
    a, b = NetworkNames.of(SCOPE, "inst-a"), NetworkNames.of("0123abcd", "inst-a")
    assert a == NetworkNames.of(SCOPE, "inst-a")
    assert a.netns == f"kibotos-{SCOPE}-inst-a"
    assert a.host_veth != b.host_veth
    assert len(NetworkNames.of(SCOPE, "inst-" + "z" * 27).host_veth) <= 15
    with pytest.raises(InvalidArgument):
        NetworkNames.of(SCOPE, "../etc")


# ---------------------------------------------------------------------------- the table


def inputs(policy: NetworkPolicy, tmp_path: Path) -> slot_table.TableInputs:
    record = NetworkRecords(tmp_path).allocate("inst-t", SCOPE, section(), policy,
                                               ["198.18.0.2"])
    return slot_table.TableInputs.from_record(record)


def test_the_table_names_every_rule_and_fills_the_sets(tmp_path: Path):
    table = inputs(NetworkPolicy(allow_out=["198.18.1.1"], deny_out=["0.0.0.0/0"]), tmp_path)
    sets = slot_table.address_sets(table)
    assert [str(n) for n in sets["guest4"]] == ["10.200.0.3/32"]
    assert [str(n) for n in sets["instances4"]] == ["10.200.0.0/24"]
    assert [str(n) for n in sets["uplink4"]] == ["198.18.0.2/32"]
    assert sets["uplink6"] == []
    assert [str(n) for n in sets["deny4"]] == ["0.0.0.0/0"]
    text = slot_table.render(table)
    rules = [line for line in text.splitlines() if line.startswith("\t\t") and
             not line.lstrip().startswith("type ")]
    assert rules
    assert all(re.search(r'comment "kibotos/1:[a-z0-9-]+"$', r) for r in rules)
    ids = [re.search(r"kibotos/1:([a-z0-9-]+)", r).group(1) for r in rules]  # type: ignore
    assert ids.index("management4") < ids.index("allow4") < ids.index("deny4") < ids.index(
        "public")  # never-reachable first; allow before deny: both lists -> allowed
    assert "dnat ip to 192.0.2.53" in text
    closed = slot_table.render(inputs(NetworkPolicy(public_egress=False), tmp_path / "b"))
    assert "kibotos/1:public" not in closed
    assert "kibotos/1:no-public-egress" in closed
    script = slot_table.replace_script(table)
    assert script.startswith("table inet kibotos\ndelete table inet kibotos\ntable inet")
    assert "redirect" not in text
    assert "th dport 15001" not in text


def test_the_table_steers_to_the_egress_process_only_when_the_policy_says(tmp_path: Path):
    egress = {"name": "corp", "revision": 1, "address": "198.18.1.2:1080"}
    resolver = {"name": "r", "revision": 1, "upstream": "192.0.2.9"}
    both = slot_table.render(inputs(NetworkPolicy(egress=egress, resolver=resolver),
                                    tmp_path))
    ids = re.findall(r"kibotos/1:([a-z0-9-]+)", both)
    # the never-reachable destinations skip the redirect (the forward chain rejects
    # them), allowed ones are redirected before denied ones skip it
    assert ids.index("egress-skip-reserved4") < ids.index("egress-allow4") < ids.index(
        "egress-skip-deny4") < ids.index("egress4")
    assert "redirect to :15001" in both
    assert "ct status dnat meta l4proto tcp th dport 15001 accept" in both
    assert "dnat ip to 192.0.2.53" not in both  # a Resolver: no DNAT to the deployment's
    assert "kibotos/1:resolver4" in both
    assert "kibotos/1:resolver6" in both
    only_resolver = slot_table.render(inputs(NetworkPolicy(resolver=resolver),
                                             tmp_path / "r"))
    assert "redirect" not in only_resolver


def _listing(*extra: dict) -> list[dict]:
    return [{"table": {"family": "inet", "name": "kibotos", "handle": 1}}, *extra]


def test_the_reader_on_listings_written_by_hand():
    wanted = {"guest4": [ipaddress.ip_network("10.200.0.3/32")]}
    guest = {"set": {"family": "inet", "table": "kibotos", "name": "guest4",
                     "type": "ipv4_addr", "elem": ["10.200.0.3"]}}
    assert set_contents({"type": "ipv4_addr", "elem": [
        {"range": ["10.0.0.0", "10.0.1.255"]}, {"prefix": {"addr": "10.0.2.0", "len": 24}},
        {"elem": {"val": "10.0.3.1"}}]}) == [ipaddress.ip_network("10.0.0.0/23"),
                                             ipaddress.ip_network("10.0.2.0/24"),
                                             ipaddress.ip_network("10.0.3.1/32")]
    same = compare(_listing(guest), _listing(), [wanted], wanted, None)
    assert same.refusals == ()
    assert same.differences == ()
    none = compare([], [], [wanted], wanted, None)
    assert none.refusals == ("the namespace has no node table (inet kibotos)",)
    foreign = compare(_listing(guest, {"table": {"family": "ip", "name": "nat"}}), _listing(),
                      [wanted], wanted, None)
    assert foreign.refusals == ("the namespace has the table ip nat, which is not the node's",)
    moved = compare(_listing(guest), _listing(), [wanted],
                    {"guest4": [ipaddress.ip_network("10.201.0.3/32")]}, None)
    assert moved.refused
    assert "the configuration now {10.201.0.3/32}" in moved.refusals[0]
    chain = {"chain": {"family": "inet", "table": "kibotos", "name": "mine"}}
    assert compare(_listing(guest, chain), _listing(), [wanted], wanted,
                   None).refusals == ("chain mine was added by hand",)
    policy = compare(_listing(guest), _listing(), [wanted], wanted, "cannot enforce")
    assert policy.refusals == ("cannot enforce",)


def test_what_the_guest_is_told_to_configure(tmp_path: Path):
    from kibotos.node.network.enforce import guest_interface_config

    record = NetworkRecords(tmp_path).allocate("inst-g", SCOPE, section(), NetworkPolicy(), [])
    assert guest_interface_config(record) == {
        "addresses": [
            {"family": "ipv4", "address": "10.200.0.3", "prefix": 31, "gateway": "10.200.0.2"},
            {"family": "ipv6", "address": "fd00:6b69::3", "prefix": 127,
             "gateway": "fd00:6b69::2"}],
        "resolvers": ["10.200.0.2"]}  # the gateway, for the family a resolver has
    own = NetworkPolicy(resolver={"name": "r", "revision": 1, "upstream": "192.0.2.9"})
    record = NetworkRecords(tmp_path).allocate("inst-r", SCOPE, section(), own, [])
    # with a Resolver the egress process answers on both gateways
    assert guest_interface_config(record)["resolvers"] == ["10.200.0.6", "fd00:6b69::6"]
