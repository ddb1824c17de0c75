"""Reading slot tables back at adoption: a table as written has no difference; one of
another version is rewritten in one transaction with a guest's connection kept; each of
the spec's four refusal cases, produced by hand, isolates the Instance instead."""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from netbed import Instance, World, ip, network_config

from kibotos.node.network import enforce, nft, slot_table
from kibotos.node.network import netns as ns
from kibotos.node.network.policy import NetworkPolicy, to_record
from kibotos.node.network.records import NetworkRecords
from kibotos.node.network.table_check import check

pytestmark = pytest.mark.root


@pytest.fixture
def instance(world: World, tmp_path: Path) -> Iterator[Instance]:
    a = Instance(world, NetworkRecords(tmp_path / "network"), network_config(), "inst-adopt",
                 NetworkPolicy(deny_out=["198.18.1.2"]))
    yield a
    a.close()


def nft_in(a: Instance, *command: str) -> None:
    subprocess.run(["ip", "netns", "exec", a.netns.name, "nft", *command], check=True)


def report(a: Instance, **config_changes: object):
    config = network_config(**config_changes)
    return check(a.record, config, enforce.uplink_addresses(config, a.world.host))


def adopt(a: Instance, **config_changes: object) -> enforce.Adoption:
    config = network_config(**config_changes)
    outcome = enforce.adopt(a.records, a.record, config,
                            enforce.uplink_addresses(config, a.world.host))
    a.record = outcome.record
    return outcome


def assert_isolated(a: Instance) -> None:
    assert a.fetch("198.18.0.1", timeout=3).startswith("failed")
    assert "state DOWN" in ip(a.netns, "link", "show", "veth0")
    tables = [t["table"]["name"] for t in nft.ruleset(a.netns, "isolated") if "table" in t]
    assert "kibotos" in tables


def test_a_table_as_written_reads_back_without_a_difference(instance):
    assert report(instance).refusals == ()
    assert report(instance).differences == ()


def test_a_table_of_another_version_is_rewritten_and_a_connection_survives(instance):
    a = instance
    old = slot_table.replace_script(slot_table.TableInputs.from_record(a.record))
    old = old.replace("ct state established,related accept", "ct state established accept")
    old = old.replace('\t\taccept comment "kibotos/1:public"\n',
                      '\t\taccept comment "kibotos/1:public"\n'
                      '\t\taccept comment "kibotos/0:retired"\n')
    nft.apply(a.netns, old, "an older version's table")
    with a.guest.socket() as conn:
        conn.settimeout(5)
        conn.connect(("198.18.0.1", 7))
        conn.sendall(b"ping")
        assert conn.recv(16) == b"ping"
        outcome = adopt(a)
        assert outcome.rewritten
        assert "rule kibotos/1:replies in chain forward differs" in outcome.report.differences
        assert ("rule kibotos/0:retired in chain forward is not one this version writes"
                in outcome.report.differences)
        assert outcome.log_fields()["netns"] == a.record.names.netns
        assert enforce.REWRITTEN_LOG == "slot table rewritten from the recorded network policy"
        conn.sendall(b"pong")
        assert conn.recv(16) == b"pong"
    assert report(a).differences == ()
    assert a.fetch("198.18.1.2", timeout=3).startswith("failed")  # the policy holds


def test_changed_resolvers_are_a_difference_the_rewrite_applies(instance):
    outcome = adopt(instance, resolvers=["198.18.1.1"])
    assert outcome.rewritten
    assert any(d.startswith("set resolver4:") for d in outcome.report.differences)
    assert instance.record.facts.resolvers == ("198.18.1.1",)


@pytest.mark.parametrize("by_hand", [
    pytest.param(["delete", "table", "inet", "kibotos"], id="no-node-table"),
    pytest.param(["add", "table", "ip", "mine"], id="a-foreign-table"),
])
def test_refused_without_the_node_table_or_with_a_foreign_one(instance, by_hand):
    nft_in(instance, *by_hand)
    outcome = adopt(instance)
    assert not outcome.rewritten
    assert any("no node table" in r or "ip mine" in r for r in outcome.report.refusals)
    assert_isolated(instance)


def test_refused_when_an_address_set_was_changed_by_hand(instance):
    nft_in(instance, "add", "element", "inet", "kibotos", "management4", "{", "10.98.0.0/16",
           "}")
    outcome = adopt(instance)
    assert not outcome.rewritten
    assert [r for r in outcome.report.refusals if r.startswith("address set management4")]
    assert_isolated(instance)


def test_refused_when_management_cidrs_changed_since_the_record(instance):
    outcome = adopt(instance, management_cidrs=["10.99.0.0/24", "10.98.0.0/16"])
    assert not outcome.rewritten
    assert [r for r in outcome.report.refusals
            if r.startswith("address set management4") and "the configuration now" in r]
    assert_isolated(instance)


def test_refused_when_the_uplink_address_changed_since_the_record(instance):
    ip(instance.world.host, "addr", "add", "198.18.0.3/24", "dev", "up0")
    outcome = adopt(instance)
    assert not outcome.rewritten
    assert [r for r in outcome.report.refusals
            if r.startswith("address set uplink4") and "the configuration now" in r]
    assert_isolated(instance)


@pytest.mark.parametrize("by_hand", [
    pytest.param(["add", "rule", "inet", "kibotos", "forward", "ip", "daddr", "10.99.0.2",
                  "accept"], id="rule"),
    pytest.param(["insert", "rule", "inet", "kibotos", "forward", "accept", "comment",
                  '"mine"'], id="rule-with-a-comment"),
    pytest.param(["add", "chain", "inet", "kibotos", "mine"], id="chain"),
])
def test_refused_when_rules_or_chains_were_added_by_hand(instance, by_hand):
    nft_in(instance, *by_hand)
    outcome = adopt(instance)
    assert not outcome.rewritten
    assert [r for r in outcome.report.refusals if "by hand" in r]
    assert_isolated(instance)


def test_refused_when_this_node_can_no_longer_enforce_the_policy(instance):
    outcome = adopt(instance, public_egress=False)
    assert not outcome.rewritten
    assert [r for r in outcome.report.refusals if "public egress" in r]
    assert_isolated(instance)


def test_a_switch_a_crash_interrupted_is_finished_by_adoption(instance):
    a = instance
    wanted = NetworkPolicy(deny_out=["198.18.0.1"])
    # the pending policy recorded, its table written, the record not updated yet
    pending = dataclasses.replace(a.record, pending_policy=to_record(wanted))
    a.records.write(pending)
    a.record = pending
    nft.apply(a.netns, slot_table.replace_script(slot_table.TableInputs.from_record(
        dataclasses.replace(pending, policy=to_record(wanted)))), "the switched table")
    outcome = adopt(a)
    assert outcome.rewritten, outcome.report.refusals
    assert a.record.policy == to_record(wanted)
    assert a.record.pending_policy is None
    assert a.records.read(a.record.instance_id) == a.record
    assert a.fetch("198.18.0.1", timeout=3).startswith("failed")
    assert a.fetch("198.18.1.1") == "198.18.1.1"


def test_refused_when_the_namespace_is_gone(instance):
    ns.remove_netns(instance.netns)  # unbound by hand (processes in it keep it alive)
    outcome = adopt(instance)
    assert not outcome.rewritten
    assert outcome.report.refusals == (f"the network namespace {instance.netns} is missing",)
