"""Every node command's arguments: the example of each is accepted and round-trips; every
rule refuses its bad values with `invalid_argument` naming the field; types are strict
and unknown fields refused."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from protocol_examples import GOOD_ARGS, HEX, MIB, good

from kibotos.core.errors import InvalidArgument
from kibotos.protocol import COMMANDS, CreateSpec, StopArgs, parse_command


def refused(kind: str, args: Any) -> str:
    with pytest.raises(InvalidArgument) as info:
        parse_command(kind, args)
    assert info.value.message.startswith(f"{kind}: ")
    return info.value.message


def with_part(kind: str, part: str, **changes: Any) -> dict[str, Any]:
    args = good(kind)
    args[part] = {**args[part], **changes}
    return args


def test_every_command_has_an_example() -> None:
    assert set(GOOD_ARGS) == set(COMMANDS)


@pytest.mark.parametrize("kind", sorted(GOOD_ARGS))
def test_the_example_is_accepted_and_round_trips(kind: str) -> None:
    parsed = parse_command(kind, good(kind))
    assert kind == type(parsed).KIND
    wire = parsed.to_wire()
    assert parse_command(kind, wire) == parsed
    assert wire == GOOD_ARGS[kind]  # ctrl's form is already canonical


@pytest.mark.parametrize("kind", sorted(GOOD_ARGS))
def test_unknown_fields_are_refused_by_name(kind: str) -> None:
    assert refused(kind, good(kind, colour="blue")) == f"{kind}: colour: unknown field"


@pytest.mark.parametrize("kind", sorted(GOOD_ARGS))
def test_args_must_be_an_object(kind: str) -> None:
    assert refused(kind, ["not", "an", "object"]) == f"{kind}: args must be an object"


@pytest.mark.parametrize("kind", sorted(GOOD_ARGS))
def test_every_required_field_is_named_when_missing(kind: str) -> None:
    model = COMMANDS[kind]
    for name, field in model.model_fields.items():
        if field.is_required():
            args = good(kind)
            del args[name]
            assert f"{name}: Field required" in refused(kind, args)


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(InvalidArgument, match=r"unknown command kind 'instance\.reboot'"):
        parse_command("instance.reboot", {})


# ------------------------------------------------------------------ strict types

INT_FIELDS = [(kind, name) for kind, args in sorted(GOOD_ARGS.items())
              for name, value in args.items() if type(value) is int]


@pytest.mark.parametrize(("kind", "name"), INT_FIELDS)
def test_integers_are_not_coerced(kind: str, name: str) -> None:
    value = GOOD_ARGS[kind][name]
    for bad in (str(value), float(value), True):
        assert f"{name}: Input should be a valid integer" in refused(kind, good(kind, **{
            name: bad}))


@pytest.mark.parametrize(("kind", "name"), INT_FIELDS)
def test_integers_have_a_ceiling(kind: str, name: str) -> None:
    assert f"{name}: " in refused(kind, good(kind, **{name: 1 << 62}))


@pytest.mark.parametrize("kind", ["instance.stop", "node.drain"])
def test_booleans_are_not_coerced(kind: str) -> None:
    name = "force" if kind == "instance.stop" else "requested"
    for bad in (1, "true", "yes"):
        assert f"{name}: Input should be a valid boolean" in refused(kind, good(kind, **{
            name: bad}))


@pytest.mark.parametrize(("kind", "name"), [
    ("instance.create", "instance_id"), ("instance.create", "workspace_id"),
    ("layer.delete", "pool_id"), ("volume.create", "volume_id"),
    ("object.import", "artifact_digest"), ("object.copy", "object_id")])
def test_ids_must_be_strings(kind: str, name: str) -> None:
    assert f"{name}: Input should be a valid string" in refused(kind, good(kind, **{name: 7}))


# ------------------------------------------------------------------ instance.create


def test_an_empty_template_is_refused_naming_each_field() -> None:
    message = refused("instance.create", good("instance.create", template={}))
    for name in ("name", "image_digest", "kernel_digest", "initramfs_digest"):
        assert f"template.{name}: Field required" in message


@pytest.mark.parametrize(("memory", "words"), [
    (0, "must be at least 64 MiB"), (63 * MIB, "must be at least 64 MiB"),
    (64 * MIB + 1, "must be a whole number of MiB"), (1 << 45, "must be at most")])
def test_memory_is_at_least_64_mib_and_whole_mib(memory: int, words: str) -> None:
    message = refused("instance.create", good("instance.create", memory_bytes=memory))
    assert f"memory_bytes: {words}" in message


def test_memory_of_64_mib_is_enough() -> None:
    spec = parse_command("instance.create", good("instance.create", memory_bytes=64 * MIB))
    assert isinstance(spec, CreateSpec)
    assert spec.memory_bytes == 64 * MIB


@pytest.mark.parametrize("cpu", [0, -1, 1_000_001])
def test_cpu_is_bounded(cpu: int) -> None:
    assert "cpu_millis: " in refused("instance.create", good("instance.create",
                                                              cpu_millis=cpu))


def test_digests_are_kept_canonical() -> None:
    args = good("instance.create")
    args["template"] = {**args["template"], "image_digest": HEX}  # bare hex accepted
    spec = parse_command("instance.create", args)
    assert isinstance(spec, CreateSpec)
    assert spec.template.image_digest == f"sha256:{HEX}"
    bad = with_part("instance.create", "template", kernel_digest="sha256:XYZ")
    assert "template.kernel_digest: invalid digest" in refused("instance.create", bad)


@pytest.mark.parametrize(("part", "field", "value", "words"), [
    ("template", "name", "-bad", "invalid template name"),
    ("template", "name", "..", "invalid template name"),
    ("layer", "pool_id", "Pool", "invalid pool ID"),
    ("layer", "ref", "a" * 33, "invalid retained layer ref"),
    ("layer", "capacity_bytes", 0, "must be at least 1 MiB"),
    ("layer", "capacity_bytes", 64 * MIB + 512, "must be a whole number of MiB"),
    ("layer", "epoch", -1, "greater than or equal to 0"),
    ("layer", "create", "yes", "valid boolean"),
    ("launch", "hostname", "h" * 65, "at most 64 characters"),
    ("launch", "env", {"1BAD": "x"}, "invalid environment variable name '1BAD'"),
    ("launch", "env", {"A": 1}, "valid string"),
])
def test_nested_rules_name_the_nested_field(part: str, field: str, value: Any,
                                            words: str) -> None:
    message = refused("instance.create", with_part("instance.create", part, **{field: value}))
    assert f"{part}." in message
    assert words in message


def test_nested_unknown_fields_are_refused() -> None:
    assert refused("instance.create", with_part("instance.create", "layer", size=1)) == \
        "instance.create: layer.size: unknown field"


@pytest.mark.parametrize(("volume", "words"), [
    ({"volume_id": "vol-1", "pool_id": "pool-a", "epoch": 1, "mount_point": "data"},
     "volumes.0.mount_point: mount point 'data' must be an absolute guest path"),
    ({"volume_id": "vol-1", "pool_id": "pool-a", "epoch": 1, "mount_point": "/etc"},
     "would hide a guest system directory"),
    ({"volume_id": "Vol", "pool_id": "pool-a", "epoch": 1}, "volumes.0.volume_id: invalid"),
])
def test_volume_rules(volume: dict[str, Any], words: str) -> None:
    assert words in refused("instance.create", good("instance.create", volumes=[volume]))


def test_volumes_are_distinct_with_distinct_mount_points() -> None:
    one = GOOD_ARGS["instance.create"]["volumes"][0]
    assert "listed twice" in refused("instance.create", good("instance.create",
                                                             volumes=[one, one]))
    other = {**one, "volume_id": "vol-2"}
    assert "two volumes share a mount point" in refused(
        "instance.create", good("instance.create", volumes=[one, other]))
    defaulted = {**one, "volume_id": "data", "mount_point": None}
    at_default = {**one, "volume_id": "vol-3", "mount_point": "/mnt/data"}
    assert "two volumes share a mount point" in refused(
        "instance.create", good("instance.create", volumes=[defaulted, at_default]))


def test_at_most_16_volumes() -> None:
    volumes = [{"volume_id": f"vol-{i}", "pool_id": "pool-a", "epoch": 1}
               for i in range(17)]
    assert "volumes: List should have at most 16 items" in refused(
        "instance.create", good("instance.create", volumes=volumes))


def test_defaults_of_a_create() -> None:
    args = good("instance.create")
    del args["volumes"], args["launch"]
    args["layer"] = {k: v for k, v in args["layer"].items() if k != "create"}
    spec = parse_command("instance.create", args)
    assert isinstance(spec, CreateSpec)
    assert spec.volumes == []
    assert spec.launch.env == {}
    assert spec.launch.hostname is None
    assert spec.layer.create is False


def test_the_create_digest_is_the_identity_of_the_arguments() -> None:
    first = parse_command("instance.create", good("instance.create"))
    again = parse_command("instance.create", copy.deepcopy(first.to_wire()))
    other = parse_command("instance.create", good("instance.create", cpu_millis=2000))
    assert isinstance(first, CreateSpec)
    assert isinstance(again, CreateSpec)
    assert isinstance(other, CreateSpec)
    assert first.digest() == again.digest() != other.digest()


def test_a_volume_mounts_at_its_default_without_a_mount_point() -> None:
    args = good("instance.create")
    args["volumes"] = [{"volume_id": "vol-9", "pool_id": "pool-a", "epoch": 1}]
    spec = parse_command("instance.create", args)
    assert isinstance(spec, CreateSpec)
    assert spec.volumes[0].mount() == "/mnt/vol-9"


# ------------------------------------------------------------------ the others


@pytest.mark.parametrize("deadline", [0, -1.0, 3601, "30"])
def test_stop_deadline_is_bounded(deadline: Any) -> None:
    assert "deadline_s: " in refused("instance.stop", good("instance.stop",
                                                            deadline_s=deadline))


def test_stop_defaults() -> None:
    parsed = parse_command("instance.stop", {"instance_id": "inst-1"})
    assert parsed == StopArgs(instance_id="inst-1", force=False, deadline_s=30.0)
    assert parse_command("instance.stop", good("instance.stop", deadline_s=5)) == \
        StopArgs(instance_id="inst-1", deadline_s=5.0)  # a JSON integer is a number


@pytest.mark.parametrize("kind", ["object.expand", "object.copy", "object.export",
                                  "object.import"])
def test_object_kind_is_one_of_two(kind: str) -> None:
    assert "kind: Input should be 'volume' or 'retained_layer'" in refused(
        kind, good(kind, kind="volumes"))
    assert parse_command(kind, good(kind, kind="retained_layer"))


def test_a_copy_needs_two_pools() -> None:
    assert refused("object.copy", good("object.copy", to_pool_id="pool-a")) == \
        "object.copy: from_pool_id and to_pool_id are both pool-a"


@pytest.mark.parametrize("capacity", [0, MIB - 1, 3 * MIB + 1])
def test_capacities_are_whole_mib(capacity: int) -> None:
    for kind in ("volume.create", "object.expand"):
        assert "capacity_bytes: " in refused(kind, good(kind, capacity_bytes=capacity))


@pytest.mark.parametrize("limit", [0, 101, "5"])
def test_registry_list_limit_is_1_to_100(limit: Any) -> None:
    assert "limit: " in refused("registry.list", {"limit": limit})
    assert parse_command("registry.list", {}).to_wire() == {"limit": 100}


def test_registry_delete_takes_at_most_100_valid_ids() -> None:
    assert "instance_ids: List should have at most 100 items" in refused(
        "registry.delete", {"instance_ids": [f"inst-{i}" for i in range(101)]})
    assert "instance_ids.1: invalid instance ID" in refused(
        "registry.delete", {"instance_ids": ["inst-1", "../etc"]})
