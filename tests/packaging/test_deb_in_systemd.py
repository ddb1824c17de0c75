"""The packages on a booted systemd, as an operator uses them: one Debian 12 nspawn
container (tests/packaging/nspawn_container.py) for every step, in order.

1. ``apt install ./*.deb`` of the six packages: nothing is enabled or started, the
   accounts exist (``kibotos-vmm`` in ``kvm``, ``kibotos-egress``).
2. ctrl and one node configured from the shipped configs (a pool directory, the
   node's grant, an operator enrolled with ``kibo``), the units enabled: the node is
   READY, its data-plane unit runs, the path to the Instance directories is handed to
   ``kibotos-vmm``.  Through ``kibo``: the ``kibotos-base`` Template is published (built
   on the host into the VM tests' cache, published from the container's network
   namespace), a Workspace boots (QEMU under TCG) with its VMM running as
   ``kibotos-vmm`` with the group ``kvm``, exec works; a Volume is created.  The E2B
   gateway, enrolled and configured as docs/gateways.md says, runs as its own
   systemd-allocated user and serves its metrics.
3. The failed-upgrade fallback (spec, "Troubleshooting"): the node stopped, a leftover
   with no owner in its storage root; upgrading to the next version (built by
   repacking with the version bumped) makes the old prerm's check refuse, dpkg says
   "trying script from the new package instead", and the new package's script, which
   only requires the node service stopped, lets the upgrade finish.
4. An upgrade with the Workspace running whose check passes: the old version's binary
   checks (the prerm says so), no fallback; the node starts on the new version and
   adopts the Instance without a guest restart (the same guest boot ID).
5. ``apt remove kibotos-node`` while the Workspace runs and the Volume exists is refused
   by the check, and the node it stopped for the check runs again; after both are
   deleted the removal passes and no ``kibotos-dataplane-*`` or VMM unit remains.
6. ``apt purge`` of all six leaves no file of the packages; the storage root, the pool,
   ctrl's store and the accounts stay (docs/uninstall.md).

The three versions are the built packages repacked (``dpkg-deb -R``, the versions in
the control files and ``kibotos/_version.py`` bumped) as releases 0.1.1, 0.1.2, 0.1.3.
The first run debootstraps the container's root file system (~3 min, cached); then the
whole test takes a few minutes, most of it repacking and apt.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from nspawn_container import Container, missing_tools, rootfs
from repack import repack

from kibotos.cli.workspace import template_images

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "packaging/template/kibotos-base.toml"

pytestmark = [pytest.mark.slow, pytest.mark.systemd, pytest.mark.root]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
CONFIG = "/etc/kibotos/node/config.toml"
#: Bounded waits inside the container (seconds).
READY_TIMEOUT = 120
#: The three versions installed in turn: the build repacked as releases on one line,
#: since a development build drives only the runtime of exactly its own version
#: (docs/upgrades.md), so its Instances could not be adopted by the next one.
VERSIONS = ("0.1.1", "0.1.2", "0.1.3")


def _cache_root() -> Path:
    return Path(os.environ.get("KIBOTOS_TEST_CACHE", "/var/cache/kibotos-test"))


def _warm_template_cache(cache: Path) -> None:
    """What ``kibo template build kibotos-base`` builds, built here, with the host's
    network (the container has none): the Platform and the image, cached by their
    inputs (shared with the VM tests, so usually already there)."""
    recipe = template_images.load_recipe(RECIPE, "kibotos-base", cache)
    template_images.build_image(recipe, cache)
    template_images.platform_blobs(None, cache)


@pytest.fixture(scope="module")
def container(debs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[Container]:
    missing = missing_tools()
    if missing:
        if IN_CI:
            pytest.fail(f"missing {missing} (packaging/apt-test-deps.txt)")
        pytest.skip(f"missing {missing}")
    packages = tmp_path_factory.mktemp("packages")
    for i, pep440 in enumerate(VERSIONS, start=1):
        repack(debs, packages / f"v{i}", pep440)
    _warm_template_cache(_cache_root())
    work = Path(tempfile.mkdtemp(prefix="kibotos-nspawn-", dir="/var/tmp"))
    box = Container(rootfs(_cache_root()), work, [(packages, "/packages")])
    try:
        yield box
    finally:
        box.close()
        subprocess.run(["rm", "-rf", "--one-file-system", str(work)], check=False)


def apt(box: Container, args: str, *, ok: bool = True) -> str:
    proc = box.run(f"apt-get -y -q -o Dpkg::Use-Pty=0 {args} 2>&1", check=False)
    assert (proc.returncode == 0) == ok, (args, proc.stdout[-6000:])
    return proc.stdout


def wait_ready(box: Container) -> None:
    box.run(f"timeout {READY_TIMEOUT} sh -c 'until kibo node list 2>/dev/null | "
            f"grep -q \"node-a *| READY\"; do sleep 0.5; done'", timeout=READY_TIMEOUT + 30)


def boot_id(box: Container, ws: str) -> str:
    """The guest's boot ID, through ``kibo workspace exec`` (the data plane)."""
    return box.run(f"kibo workspace exec {ws} -- cat /proc/sys/kernel/random/boot_id"
                   ).stdout.strip()


def version_of(box: Container, package: str) -> str:
    return box.run(["dpkg-query", "-W", "-f=${Version} ${Status}", package]).stdout


def start_e2b_gateway(box: Container) -> None:
    """The E2B gateway from its shipped configuration, as docs/gateways.md ("From the
    package") sets it up: its own operator identity, the credential root's file, ctrl's
    CA copied; it runs as its systemd-allocated user and serves its metrics."""
    box.run("""
g=$(kibotos ctrl grant --config /etc/kibotos/ctrl.toml --kind operator)
kibo enroll --config /root/gw.toml --ctrl-url https://127.0.0.1:7400 \
    --ca-file /etc/kibotos/node/ctrl-ca.crt --grant "$g"
(umask 077; python3.11 -c \
    'import sys, tomllib; print(tomllib.load(sys.stdin.buffer)["credential"])' \
    < /root/gw.toml > /etc/kibotos/gateway-e2b.credential)
rm /root/gw.toml
cp /etc/kibotos/node/ctrl-ca.crt /etc/kibotos/ctrl-ca.crt
systemctl enable --now kibotos-e2b-gateway
timeout 60 sh -c 'until test -s /var/lib/kibotos/gateway-e2b/listen-address; do sleep 0.3; done'
""")
    # A DynamicUser's UID is from systemd's range 61184-65519 (its name resolves only
    # where libnss-systemd is installed).
    uid = box.run("ps -o uid= -p $(systemctl show -P MainPID kibotos-e2b-gateway)"
                  ).stdout.strip()
    assert 61184 <= int(uid) <= 65519, uid
    assert box.run("getent passwd kibotos-e2b-gateway || true").stdout.strip() == "", \
        "DynamicUser: no account in /etc/passwd"
    metrics = box.run("python3.11 -c 'import urllib.request; print(urllib.request.urlopen("
                      "\"http://\" + open(\"/var/lib/kibotos/gateway-e2b/listen-address\")"
                      ".read().strip() + \"/metrics\", timeout=30).read().decode())'").stdout
    assert "kibotos_gateway_e2b_http_requests" in metrics, metrics[:2000]


def test_install_configure_upgrade_remove_purge(container: Container) -> None:
    box = container

    # 1. install: nothing enabled or started, the accounts.
    out = apt(box, "install /packages/v1/*.deb")
    assert "check-maintenance" not in out
    units = "kibotos-node kibotos-ctrl kibotos-e2b-gateway"
    states = box.run(f"systemctl is-enabled {units} || true; "
                     f"systemctl is-active {units} || true").stdout.split()
    assert states == ["disabled"] * 3 + ["inactive"] * 3, states
    assert "kvm" in box.run(["id", "-nG", "kibotos-vmm"]).stdout.split()
    box.run(["getent", "passwd", "kibotos-egress"])
    box.run("test -d /usr/lib/kibotos/venv/lib/python3.11/site-packages/kibotos/__pycache__")
    names = ("kibotos-node kibotos-ctrl kibotos-cli kibotos-e2b-gateway "
             "kibotos-exposure-gateway kibotos-common")
    box.run(f"dpkg -L {names} > /root/package-files")

    # 2. ctrl and the node from the shipped configs, enabled by the operator.
    box.run("""
mkdir -p /var/lib/kibotos/pool-a
chown root:kibotos-vmm /var/lib/kibotos/pool-a && chmod 0710 /var/lib/kibotos/pool-a
kibotos-node storage-pool init --id pool-a --path /var/lib/kibotos/pool-a
systemctl enable --now kibotos-ctrl
kibotos ctrl grant --config /etc/kibotos/ctrl.toml --kind node --node-id node-a \
    > /etc/kibotos/node/grant
chmod 0600 /etc/kibotos/node/grant
g=$(kibotos ctrl grant --config /etc/kibotos/ctrl.toml --kind operator)
timeout 60 sh -c "until cp /var/lib/kibotos/ctrl/cluster-ca.crt /etc/kibotos/node/ctrl-ca.crt \
    && kibo enroll --ctrl-url https://127.0.0.1:7400 --ca-file /etc/kibotos/node/ctrl-ca.crt \
    --grant $g; do sleep 0.3; done"
systemctl enable --now kibotos-node
""")
    wait_ready(box)
    assert box.run("systemctl list-units 'kibotos-dataplane-*' --plain --no-legend").stdout
    start_e2b_gateway(box)
    modes = box.run("cd /var/lib/kibotos/node && stat -c '%a %U:%G' . runtime "
                    "runtime/instances state").stdout.splitlines()
    assert modes == ["710 root:kibotos-vmm"] * 3 + ["700 root:root"], modes
    box.run("kibo storage-pool set-capacity pool-a 4G")
    kibo_config = f"/proc/{box.leader}/root/root/.config/kibotos/kibo.toml"
    box.host_in_netns([str(Path(sys.executable).parent / "kibo"), "template", "build",
                       "kibotos-base", "--recipe", str(RECIPE), "--cache-dir",
                       str(_cache_root())], {"KIBO_CONFIG": kibo_config})
    created = box.run("kibo workspace create --template kibotos-base --memory 512M "
                      "--layer-size 1G --timeout 10m").stdout
    found = re.search(r"workspace (ws-[0-9a-z]+) AVAILABLE on node node-a", created)
    assert found, created
    ws = found.group(1)
    vmm = box.run("u=$(systemctl list-units 'kibotos-vmm-*' --plain --no-legend | "
                  "cut -d' ' -f1); ps -o user:32=,supgrp:64= -p $(systemctl show -P MainPID $u)"
                  ).stdout.split()
    assert vmm[0] == "kibotos-vmm", vmm
    assert "kvm" in vmm[1].split(","), vmm
    booted = boot_id(box, ws)
    assert re.fullmatch(r"[0-9a-f-]{36}", booted), booted
    created = box.run("kibo volume create --size 64M --pool pool-a").stdout
    volume = re.search(r"\bvol-[0-9a-z]+", created)
    assert volume, created

    # 3. the failed-upgrade fallback: the old check refuses, the new script goes on.
    box.run("systemctl stop kibotos-node")
    box.run(["mkdir", "/var/lib/kibotos/node/runtime/instances/inst-leftover"])
    out = apt(box, "install /packages/v2/*.deb")
    assert f"with the installed kibotos-node {VERSIONS[0]}" in out
    assert "inst-leftover has no Instance record: a leftover with no owner" in out
    assert "check-maintenance --operation upgrade: 1 blocking item(s)" in out
    assert "old kibotos-node package pre-removal script subprocess returned error " \
           "exit status 1" in out
    assert "trying script from the new package instead" in out
    assert "the upgrade goes on with kibotos-node.service stopped" in out
    assert version_of(box, "kibotos-node") == f"{VERSIONS[1]} install ok installed"
    box.run(["rmdir", "/var/lib/kibotos/node/runtime/instances/inst-leftover"])
    box.run("systemctl start kibotos-node")
    wait_ready(box)

    assert boot_id(box, ws) == booted

    # 4. an upgrade whose check passes, with the installed (old) version's binary, with
    #    the Workspace running: the new node adopts it, the guest does not restart.
    box.run("systemctl stop kibotos-node")
    out = apt(box, "install /packages/v3/*.deb")
    assert f"with the installed kibotos-node {VERSIONS[1]}" in out
    assert "matches its launch record" in out
    assert "check-maintenance --operation upgrade: passed" in out
    assert "trying script from the new package" not in out
    assert version_of(box, "kibotos-common") == f"{VERSIONS[2]} install ok installed"
    assert box.run("systemctl is-active kibotos-node || true").stdout.strip() == "inactive"
    box.run("systemctl start kibotos-node")
    wait_ready(box)
    assert VERSIONS[2] in box.run("kibo --version").stdout
    assert boot_id(box, ws) == booted

    # 5. remove: refused while the Workspace runs and the node holds the Volume, and
    #    the node runs again.
    out = apt(box, "remove kibotos-node", ok=False)
    assert re.search(r"instance inst-\S+ is active or requires cleanup", out), out
    assert f"detached volume {volume.group(0)} in storage pool pool-a is held" in out
    assert "kibotos-node: not removed" in out
    assert box.run("systemctl is-active kibotos-node").stdout.strip() == "active"
    assert version_of(box, "kibotos-node") == f"{VERSIONS[2]} install ok installed"
    wait_ready(box)
    box.run(f"kibo workspace stop {ws} --timeout 10m")
    box.run(f"kibo workspace delete {ws} --wait --timeout 10m")
    box.run(f"kibo volume delete {volume.group(0)} --wait --timeout 5m")
    out = apt(box, "remove kibotos-node")
    assert "check-maintenance --operation remove: passed" in out
    assert box.run("systemctl list-units 'kibotos-dataplane-*' 'kibotos-egress-*' "
                   "'kibotos-vmm-*' --all --plain --no-legend").stdout.strip() == ""
    assert box.run("systemctl is-active kibotos-node || true").stdout.strip() == "inactive"

    # 6. purge: no file of the packages; state and accounts stay.  The copy of ctrl's
    #    CA the gateway reads is the operator's file (docs/uninstall.md).
    box.run("rm /etc/kibotos/ctrl-ca.crt")
    apt(box, f"purge {names}")
    assert box.run("systemctl is-active kibotos-e2b-gateway || true").stdout.strip() in (
        "inactive", "unknown")
    left = box.run("while read -r f; do if [ -e \"$f\" ] && [ ! -d \"$f\" ]; then "
                   "echo \"$f\"; fi; done < /root/package-files").stdout
    assert left == "", left
    box.run("test ! -e /usr/lib/kibotos && test ! -e /etc/kibotos && "
            "test ! -e /run/kibotos/node && ! ls -d /usr/share/doc/kibotos-* 2>/dev/null")
    box.run("test -d /var/lib/kibotos/node/pki && test -d /var/lib/kibotos/pool-a/volumes "
            "&& test -d /var/lib/kibotos/ctrl")
    box.run("getent passwd kibotos-vmm kibotos-egress")
    assert box.run(f"dpkg-query -W -f='${{Status}}\\n' {names} 2>&1 || true").stdout.count(
        "ok installed") == 0
