"""What the egress unit asks of a supervisor: its name, the spec's properties, and that
the systemd plugin turns every one of them into what systemd takes (a property it did
not know would be refused there, not silently dropped)."""

from __future__ import annotations

from pathlib import Path

from kibotos_systemd.properties import unit_properties as systemd_properties

from kibotos.backends import UnitSpec
from kibotos.egress.wire import control_path, socket_dir_of
from kibotos.node.egress import units


def test_names_and_generations():
    assert units.unit_name("0123abcd", 7) == "kibotos-egress-0123abcd-7"
    assert units.generation_of("kibotos-egress-0123abcd-7.service", "0123abcd") == 7
    assert units.generation_of("kibotos-egress-0123abcd-7", "ffffffff") is None
    assert units.generation_of("kibotos-dataplane-0123abcd-7", "0123abcd") is None
    assert socket_dir_of(Path("/run/kibotos/node")) == Path("/run/kibotos/node-egress")
    assert control_path(Path("/run/kibotos/node-egress"), 3) == \
        Path("/run/kibotos/node-egress/control-3.sock")


def test_the_unit_is_unprivileged_and_systemd_takes_every_property():
    props = units.unit_properties(egress_dir=Path("/run/kibotos/node-egress"),
                                  storage_root=Path("/var/lib/kibotos/node"),
                                  user="kibotos-egress", host_netns=None)
    assert props["Slice"] == "kibotos-egress.slice"
    assert (props["Restart"], props["KillMode"]) == ("no", "control-group")
    assert props["User"] == "kibotos-egress"
    assert props["NoNewPrivileges"] is True
    assert props["CapabilityBoundingSet"] == []
    assert props["ProtectSystem"] == "strict"
    assert props["ReadWritePaths"] == ["/run/kibotos/node-egress"]
    assert props["InaccessiblePaths"] == ["/var/lib/kibotos/node"]
    assert "NetworkNamespacePath" not in props  # the node's own: the host's
    spec = UnitSpec(name="kibotos-egress-0123abcd-1", argv=["/usr/bin/kibotos", "egress"],
                    properties=props)
    converted = dict(systemd_properties(spec, spec.name, list(spec.argv), None))
    assert converted["CapabilityBoundingSet"] == ("t", 0)
    assert converted["AmbientCapabilities"] == ("t", 0)
    assert converted["NoNewPrivileges"] == ("b", True)
    assert converted["ReadWritePaths"] == ("as", ["/run/kibotos/node-egress"])
