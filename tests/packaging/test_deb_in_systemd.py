"""The packages on a booted systemd, as an operator uses them: one Debian 12 nspawn
container (tests/packaging/nspawn_container.py) for every step, in order.

1. ``apt install ./*.deb`` of the four packages: nothing is enabled or started, the
   accounts exist (``kibotos-vmm`` in ``kvm``, ``kibotos-egress``).
2. ctrl and one node configured from the shipped configs (a pool directory, the
   node's grant, an operator enrolled with ``kibo``), the units enabled: the node is
   READY, its data-plane unit runs, the path to the Instance directories is handed to
   ``kibotos-vmm``.  Through ``kibo``: the ``kibotos-base`` Template is published (built
   on the host into the VM tests' cache, published from the container's network
   namespace), a Workspace boots (QEMU under TCG) with its VMM running as
   ``kibotos-vmm`` with the group ``kvm``, exec works; a Volume is created.
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
6. ``apt purge`` of all four leaves no file of the packages; the storage root, the pool,
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

from kibotos._version import __version__
from kibotos.cli import template_images

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


def _debian(pep440: str) -> str:
    return re.sub(r"\.?(dev|a|b|rc)(\d+)$", r"~\1\2", pep440)


def _repack(debs: dict[str, Path], out: Path, pep440: str) -> None:
    """The same packages as the next release: the control files' versions (and the
    exact dependencies on kibotos-common) and kibotos._version bumped."""
    old, new = _debian(__version__), _debian(pep440)
    out.mkdir()
    for deb in debs.values():
        tree = Path(tempfile.mkdtemp(dir=out.parent))
        subprocess.run(["dpkg-deb", "-R", str(deb), str(tree)], check=True, timeout=300)
        control = tree / "DEBIAN/control"
        control.write_text(control.read_text().replace(old, new))
        version = tree / "usr/lib/kibotos/venv/lib/python3.11/site-packages/kibotos/_version.py"
        if version.exists():
            version.write_text(re.sub(r'(?m)^__version__ = ".*"$',
                                      f'__version__ = "{pep440}"', version.read_text()))
        subprocess.run(["dpkg-deb", "-Zgzip", "-b", str(tree), str(out)], check=True,
                       capture_output=True, timeout=600)
        subprocess.run(["rm", "-rf", str(tree)], check=True)


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
        _repack(debs, packages / f"v{i}", pep440)
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


def test_install_configure_upgrade_remove_purge(container: Container) -> None:
    box = container

    # 1. install: nothing enabled or started, the accounts.
    out = apt(box, "install /packages/v1/*.deb")
    assert "check-maintenance" not in out
    states = box.run("systemctl is-enabled kibotos-node kibotos-ctrl || true; "
                     "systemctl is-active kibotos-node kibotos-ctrl || true").stdout.split()
    assert states == ["disabled", "disabled", "inactive", "inactive"], states
    assert "kvm" in box.run(["id", "-nG", "kibotos-vmm"]).stdout.split()
    box.run(["getent", "passwd", "kibotos-egress"])
    box.run("test -d /usr/lib/kibotos/venv/lib/python3.11/site-packages/kibotos/__pycache__")
    names = "kibotos-node kibotos-ctrl kibotos-cli kibotos-common"
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

    # 6. purge: no file of the packages; state and accounts stay.
    apt(box, f"purge {names}")
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
