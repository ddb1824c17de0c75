"""The ``systemd`` supervisor without a systemd: options, names, and the UnitSpec →
``StartTransientUnit`` property list (D-Bus types, conversions, refusals)."""

from __future__ import annotations

import os

import pytest
from kibotos_systemd.processes import plausible_start
from kibotos_systemd.properties import INFINITY, convert, unit_properties

from kibotos.backends import Supervisor, UnitSpec
from kibotos.core.errors import InvalidArgument, Unavailable
from kibotos.plugins import load_plugins

VMM_PROPERTIES = {  # what the qemu backend asks for (spec, "VMM service")
    "Type": "exec", "Restart": "no", "KillMode": "control-group", "OOMPolicy": "kill",
    "Slice": "kibotos-vmm.slice", "LimitMEMLOCK": "infinity", "PrivateMounts": False,
    "User": "kibotos-vmm", "SupplementaryGroups": ["kvm"],
    "NetworkNamespacePath": "/run/netns/kibotos-i-1",
}


def systemd_class() -> type:
    return load_plugins().supervisor.get("systemd")


def props_of(spec: UnitSpec, log=None) -> dict:
    return dict(unit_properties(spec, "u.service", list(spec.argv), log))


def test_the_vmm_properties_get_systemds_types(tmp_path):
    spec = UnitSpec(name="kibotos-vmm-x.service", argv=["/usr/bin/qemu", "-M", "microvm"],
                    properties=VMM_PROPERTIES, environment={"A": "1"},
                    working_directory=tmp_path, log_path=tmp_path / "vmm.log")
    props = props_of(spec, tmp_path / "vmm.log")
    assert props["Type"] == ("s", "exec")
    assert props["Restart"] == ("s", "no")
    assert props["KillMode"] == ("s", "control-group")
    assert props["OOMPolicy"] == ("s", "kill")
    assert props["Slice"] == ("s", "kibotos-vmm.slice")
    assert props["LimitMEMLOCK"] == ("t", INFINITY) == ("t", 2**64 - 1)
    assert props["LimitMEMLOCKSoft"] == ("t", INFINITY)
    assert props["PrivateMounts"] == ("b", False)
    assert props["User"] == ("s", "kibotos-vmm")
    assert props["SupplementaryGroups"] == ("as", ["kvm"])
    assert props["NetworkNamespacePath"] == ("s", "/run/netns/kibotos-i-1")
    assert props["Environment"] == ("as", [
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "A=1"])
    assert props["WorkingDirectory"] == ("s", str(tmp_path))
    assert props["StandardOutputFileToAppend"] == ("s", str(tmp_path / "vmm.log"))
    assert props["StandardErrorFileToAppend"] == ("s", str(tmp_path / "vmm.log"))
    assert props["ExecStartEx"] == ("a(sasas)", [
        ("/usr/bin/qemu", ["/usr/bin/qemu", "-M", "microvm"], ["no-env-expand"])])
    assert props["AddRef"] == ("b", True)


def test_defaults_type_exec_and_journal_output():
    props = props_of(UnitSpec(name="x", argv=["sleep", "1"]))
    assert props["Type"] == ("s", "exec")
    assert "StandardOutputFileToAppend" not in props  # the journal
    assert "WorkingDirectory" not in props
    env = dict(v.split("=", 1) for v in props["Environment"][1])
    assert env == {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    own = props_of(UnitSpec(name="x", argv=["sleep", "1"], environment={"PATH": "/opt"}))
    assert own["Environment"] == ("as", ["PATH=/opt"])


@pytest.mark.parametrize(("name", "value", "expected"), [
    ("PrivateMounts", "no", ("b", False)),
    ("SendSIGKILL", "yes", ("b", True)),
    ("OOMScoreAdjust", -900, ("i", -900)),
    ("LimitNOFILE", 65536, ("t", 65536)),
    ("MemoryMax", "infinity", ("t", INFINITY)),
    ("TasksMax", 0, ("t", 0)),
    ("CapabilityBoundingSet", [], ("t", 0)),
    ("CapabilityBoundingSet", ["CAP_NET_ADMIN", "net_raw"], ("t", (1 << 12) | (1 << 13))),
    ("UMask", 0o077, ("u", 0o077)),
    ("ReadWritePaths", ["/run/kibotos/node-egress"], ("as", ["/run/kibotos/node-egress"])),
])
def test_conversions(name, value, expected):
    assert convert("u.service", name, value) == expected


@pytest.mark.parametrize(("name", "value", "message"), [
    ("MemoryMaxx", 1, "unknown unit property 'MemoryMaxx'"),
    ("ExecStart", "/bin/true", "comes from the unit spec"),
    ("Environment", ["A=1"], "comes from the unit spec"),
    ("PrivateMounts", "maybe", "expected a boolean"),
    ("OOMScoreAdjust", "-900", "expected an integer"),
    ("OOMScoreAdjust", True, "expected an integer"),
    ("LimitMEMLOCK", -1, "non-negative integer or 'infinity'"),
    ("LimitMEMLOCK", 2**64, "non-negative integer or 'infinity'"),
    ("Slice", 3, "expected a string"),
    ("SupplementaryGroups", "kvm", "a list of strings"),
    ("CapabilityBoundingSet", ["CAP_FLY"], "capability name"),
    ("UMask", -1, "non-negative integer"),
])
def test_bad_property_values_are_refused_by_name(name, value, message):
    with pytest.raises(InvalidArgument, match=f"unit u.service: .*{message}"):
        convert("u.service", name, value)


def test_a_type_without_exec_semantics_is_refused():
    with pytest.raises(InvalidArgument, match="Type='simple' is not supported"):
        props_of(UnitSpec(name="x", argv=["sleep", "1"], properties={"Type": "simple"}))
    assert props_of(UnitSpec(name="x", argv=["sleep", "1"],
                             properties={"Type": "notify"}))["Type"] == ("s", "notify")


def test_bad_environment_names_are_refused():
    with pytest.raises(InvalidArgument, match="invalid environment variable name 'A=B'"):
        props_of(UnitSpec(name="x", argv=["sleep", "1"], environment={"A=B": "c"}))


# ---------------------------------------------------------------------------- the class


def test_options_are_checked():
    cls = systemd_class()
    with pytest.raises(InvalidArgument,
                       match=r"^\[supervisor\.systemd\]: unknown option state_dir "):
        cls({"state_dir": "/tmp"})
    with pytest.raises(InvalidArgument, match="is not a unix: D-Bus address"):
        cls({"bus": "tcp:host=localhost"})
    with pytest.raises(InvalidArgument, match=r"^\[supervisor\.systemd\] start_timeout: must "
                       r"be a positive number of seconds, got 0$"):
        cls({"start_timeout": 0})
    sup = cls({"bus": "unix:path=/x", "start_timeout": 5})
    assert isinstance(sup, Supervisor)
    assert sup.bus_address == "unix:path=/x"


def test_the_bus_defaults_to_the_system_bus(monkeypatch):
    monkeypatch.delenv("DBUS_SYSTEM_BUS_ADDRESS", raising=False)
    assert systemd_class()({}).bus_address == "unix:path=/run/dbus/system_bus_socket"
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", "unix:path=/elsewhere")
    assert systemd_class()({}).bus_address == "unix:path=/elsewhere"


@pytest.mark.parametrize("name", ["", ".hidden", "a/b", "x" * 201, "sp ace"])
async def test_bad_unit_names_are_refused(name):
    sup = systemd_class()({"bus": "unix:path=/nonexistent"})
    with pytest.raises(InvalidArgument, match="invalid unit name"):
        await sup.start(UnitSpec(name=name, argv=["true"]))
    with pytest.raises(InvalidArgument, match="invalid unit name"):
        await sup.describe(name)
    with pytest.raises(InvalidArgument, match="invalid unit name"):
        await sup.stop(name, timeout=1)


async def test_empty_argv_and_bad_prefix_are_refused():
    sup = systemd_class()({"bus": "unix:path=/nonexistent"})
    with pytest.raises(InvalidArgument, match="argv is empty"):
        await sup.start(UnitSpec(name="empty", argv=[]))
    with pytest.raises(InvalidArgument, match="invalid unit name prefix"):
        await sup.list("kibotos-*")


async def test_a_bus_that_is_not_there_is_unavailable(tmp_path):
    sup = systemd_class()({"bus": f"unix:path={tmp_path / 'no-bus'}"})
    with pytest.raises(Unavailable, match="cannot connect to the D-Bus bus"):
        await sup.describe("anything")
    with pytest.raises(Unavailable, match="cannot connect to the D-Bus bus"):
        await sup.start(UnitSpec(name="x", argv=["true"]))


def test_a_main_pid_is_plausible_only_near_systemds_fork_time():
    """``ExecMainStartTimestampMonotonic`` against the process's start time (boot-time
    ticks): the real main process started at the timestamp; a process that got the PID
    later did not."""
    tck = os.sysconf("SC_CLK_TCK")
    exec_start_usec = 5_000_000_000  # 5000 s after boot
    assert plausible_start(5000 * tck, exec_start_usec)
    assert plausible_start(5000 * tck - 1, exec_start_usec)  # a tick of rounding
    assert not plausible_start(4990 * tck, exec_start_usec)  # started before systemd forked
    assert not plausible_start(7000 * tck, exec_start_usec)  # a later process (no suspend)
    assert plausible_start(123, 0)  # systemd did not say: its MainPID is all there is


def test_the_qemu_backends_unit_properties_are_all_accepted():
    """What the built-in VMM backend asks for converts without a refusal."""
    backend = pytest.importorskip("kibotos_qemu.backend")
    props = {**backend.UNIT_PROPERTIES, "Description": "kibotos VMM (qemu) for i-1",
             "User": "kibotos-vmm", "SupplementaryGroups": ["kvm"]}
    converted = props_of(UnitSpec(name="kibotos-vmm-i-1.service", argv=["qemu"],
                                  properties=props))
    assert converted["LimitMEMLOCK"] == converted["LimitMEMLOCKSoft"] == ("t", INFINITY)
    assert converted["OOMPolicy"] == ("s", "kill")
