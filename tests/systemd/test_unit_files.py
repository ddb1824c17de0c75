"""The shipped unit files (contrib/systemd): `systemd-analyze verify` accepts them, and
they carry the spec's settings ("The node service", "VMM service" slices).

verify runs with ``--root`` on a throwaway tree: the host's unit directory copied in (the
targets the units order against), the contrib files in ``etc/systemd/system``, and
stand-ins for ``/usr/bin/kibotos-node`` and ``/usr/bin/kibotos`` (verify checks that
ExecStart= is executable; the package is not installed here).  Any output counts as a
failure: verify reports a bad value as a warning with exit status 0.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONTRIB = ROOT / "contrib" / "systemd"
UNITS = sorted(p.name for p in CONTRIB.iterdir())
HOST_UNITS = Path("/usr/lib/systemd/system")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def settings(name: str) -> dict[str, list[str]]:
    """key → values of a unit file (every section; comments and blank lines skipped)."""
    found: dict[str, list[str]] = {}
    for line in (CONTRIB / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        found.setdefault(key.strip(), []).append(value.strip())
    return found


@pytest.fixture
def verify_root(tmp_path: Path) -> Path:
    if shutil.which("systemd-analyze") is None or not HOST_UNITS.is_dir():
        if IN_CI:
            pytest.fail("systemd-analyze missing; .ci/run must install systemd")
        pytest.skip("systemd-analyze not installed")
    root = tmp_path / "root"
    shutil.copytree(HOST_UNITS, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    for name in UNITS:
        shutil.copy(CONTRIB / name, root / "etc/systemd/system" / name)
    (root / "usr/bin").mkdir(parents=True, exist_ok=True)
    for tool in ("kibotos-node", "kibotos"):
        (root / "usr/bin" / tool).write_text("#!/bin/sh\n")
        (root / "usr/bin" / tool).chmod(0o755)
    return root


def verify(root: Path, *units: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", "verify", f"--root={root}", *units],
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_shipped_units_are_the_ones_this_test_knows():
    assert UNITS == ["kibotos-ctrl.service", "kibotos-dataplane.slice",
                     "kibotos-e2b-gateway.service", "kibotos-egress.slice",
                     "kibotos-exposure-gateway.service",
                     "kibotos-node.service", "kibotos-vmm.slice", "kibotos.slice"]


def test_systemd_analyze_verify_accepts_every_unit(verify_root):
    done = verify(verify_root, *UNITS)
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


def test_verify_would_catch_a_bad_setting(verify_root):
    """The check above can fail: a misspelt key and a bad value are reported."""
    target = verify_root / "etc/systemd/system/kibotos-node.service"
    target.write_text(target.read_text().replace("KillMode=control-group", "KillMode=bogus")
                      .replace("RestartSec=", "RestartSecs="))
    done = verify(verify_root, "kibotos-node.service")
    output = done.stdout + done.stderr
    assert "kill mode" in output
    assert "Unknown key 'RestartSecs'" in output
    (verify_root / "usr/bin/kibotos-node").unlink()
    target.write_text((CONTRIB / "kibotos-node.service").read_text())
    missing = verify(verify_root, "kibotos-node.service")
    assert missing.returncode != 0
    assert "/usr/bin/kibotos-node is not executable" in missing.stdout + missing.stderr


def test_the_node_service_has_the_spec_settings():
    node = settings("kibotos-node.service")
    assert node["Type"] == ["notify"]
    assert node["ExecStart"] == [
        "/usr/bin/kibotos-node serve --config /etc/kibotos/node/config.toml"]
    assert node["Restart"] == ["on-failure"]
    assert node["RestartSec"] == ["5s"]
    assert node["KillMode"] == ["control-group"]
    assert node["SendSIGKILL"] == ["yes"]
    assert node["OOMScoreAdjust"] == ["-900"]
    assert node["Environment"] == ["LIBGUESTFS_BACKEND=direct"]
    # No stop dependency between the node and the services it starts.
    for key in ("BindsTo", "PartOf", "Requires", "Requisite", "Upholds"):
        assert key not in node


def test_the_ctrl_service_runs_ctrl_serve():
    ctrl = settings("kibotos-ctrl.service")
    assert ctrl["ExecStart"] == ["/usr/bin/kibotos ctrl serve --config /etc/kibotos/ctrl.toml"]
    assert ctrl["Restart"] == ["on-failure"]


@pytest.mark.parametrize("kind", ["e2b", "exposure"])
def test_the_gateway_services_run_unprivileged_with_the_shipped_config(kind: str) -> None:
    """Each gateway's unit: its own systemd-allocated user, no capabilities; the
    credential the shipped configuration names is the one the unit hands over, the state
    directory the one the configuration uses (debian/conf/<kind>-gateway.toml)."""
    from kibotos import config
    from kibotos.gateway.e2b.config import GatewayConfig
    from kibotos.gateway.exposure.config import ExposureConfig

    package = f"kibotos-{kind}-gateway"
    unit = settings(f"{package}.service")
    assert unit["ExecStart"] == [
        f"/usr/bin/kibotos gateway {kind} serve --config /etc/kibotos/{kind}-gateway.toml"]
    assert unit["DynamicUser"] == ["yes"]
    assert unit["User"] == [package]
    assert unit["CapabilityBoundingSet"] == [""]
    for key in ("NoNewPrivileges", "PrivateTmp", "PrivateDevices", "ProtectHome"):
        assert unit[key] == ["yes"], key
    assert unit["ProtectSystem"] == ["strict"]
    path = ROOT / f"debian/conf/{kind}-gateway.toml"
    shipped = (config.load(GatewayConfig, path) if kind == "e2b"
               else config.load(ExposureConfig, path))
    name, _, source = unit["LoadCredential"][0].partition(":")
    assert source == f"/etc/kibotos/gateway-{kind}.credential"
    assert shipped.ctrl.credential_file == Path(
        f"/run/credentials/{package}.service") / name
    assert shipped.state_dir == Path("/var/lib") / unit["StateDirectory"][0]
    assert unit["StateDirectoryMode"] == ["0700"]


@pytest.mark.parametrize("name", ["kibotos.slice", "kibotos-vmm.slice",
                                  "kibotos-dataplane.slice", "kibotos-egress.slice"])
def test_slices_are_plain_slices(name):
    """Slice nesting comes from the name (kibotos-vmm.slice sits in kibotos.slice, as the
    supervisor test sees in the cgroup path); the files only describe them."""
    assert set(settings(name)) <= {"Description", "Before"}
