"""The packages on a booted systemd, as an operator uses them: one Debian 12 nspawn
container (tests/packaging/nspawn_container.py) for every step, in order.

1. ``apt install ./*.deb`` of the four packages: nothing is enabled or started, the
   accounts exist (``kibotos-vmm`` in ``kvm``, ``kibotos-egress``).
2. ctrl and one node configured from the shipped configs (a pool directory, the
   node's grant, an operator enrolled with ``kibo``), the units enabled: the node is
   READY, its data-plane unit runs, the path to the Instance directories is handed to
   ``kibotos-vmm``; a Volume is created (a resource the node holds).
3. The failed-upgrade fallback (spec, "Troubleshooting"): the node stopped, a leftover
   with no owner in its storage root; upgrading to the next version (built by
   repacking with the version bumped) makes the old prerm's check refuse, dpkg says
   "trying script from the new package instead", and the new package's script, which
   only requires the node service stopped, lets the upgrade finish.
4. An upgrade whose check passes: the old version's binary checks (the prerm says so),
   no fallback, and the node starts on the new version and comes back READY.
5. ``apt remove kibotos-node`` while the Volume exists is refused by the check, and
   the node it stopped for the check runs again; after the Volume is deleted the
   removal passes and no ``kibotos-dataplane-*`` unit remains.
6. ``apt purge`` of all four leaves no file of the packages; the storage root, the pool,
   ctrl's store and the accounts stay (docs/uninstall.md).

Booting a Workspace inside the container is not part of it yet (docs/packaging.md).
The first run debootstraps the container's root file system (~3 min, cached); then the
whole test takes a few minutes, most of it repacking and apt.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from nspawn_container import Container, missing_tools, rootfs

from kibotos._version import __version__

pytestmark = [pytest.mark.slow, pytest.mark.systemd, pytest.mark.root]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
CONFIG = "/etc/kibotos/node/config.toml"
#: Bounded waits inside the container (seconds).
READY_TIMEOUT = 120
NEXT = ("0.1.1", "0.1.2")


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


@pytest.fixture(scope="module")
def container(debs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[Container]:
    missing = missing_tools()
    if missing:
        if IN_CI:
            pytest.fail(f"missing {missing} (packaging/apt-test-deps.txt)")
        pytest.skip(f"missing {missing}")
    packages = tmp_path_factory.mktemp("packages")
    (packages / "v1").mkdir()
    for deb in debs.values():
        shutil.copy(deb, packages / "v1")
    for i, pep440 in enumerate(NEXT, start=2):
        _repack(debs, packages / f"v{i}", pep440)
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
timeout 60 sh -c "until kibo enroll --ctrl-url http://127.0.0.1:7400 --grant $g; do
    sleep 0.3; done"
systemctl enable --now kibotos-node
""")
    wait_ready(box)
    assert box.run("systemctl list-units 'kibotos-dataplane-*' --plain --no-legend").stdout
    modes = box.run("cd /var/lib/kibotos/node && stat -c '%a %U:%G' . runtime "
                    "runtime/instances state").stdout.splitlines()
    assert modes == ["710 root:kibotos-vmm"] * 3 + ["700 root:root"], modes
    box.run("kibo storage-pool set-capacity pool-a 1G")
    created = box.run("kibo volume create --size 64M --pool pool-a").stdout
    volume = re.search(r"\bvol-[0-9a-z]+", created)
    assert volume, created

    # 3. the failed-upgrade fallback: the old check refuses, the new script goes on.
    box.run("systemctl stop kibotos-node")
    box.run(["mkdir", "/var/lib/kibotos/node/runtime/instances/inst-leftover"])
    out = apt(box, "install /packages/v2/*.deb")
    assert f"with the installed kibotos-node {__version__}" in out
    assert "inst-leftover has no Instance record: a leftover with no owner" in out
    assert "check-maintenance --operation upgrade: 1 blocking item(s)" in out
    assert "old kibotos-node package pre-removal script subprocess returned error " \
           "exit status 1" in out
    assert "trying script from the new package instead" in out
    assert "the upgrade goes on with kibotos-node.service stopped" in out
    assert version_of(box, "kibotos-node") == f"{NEXT[0]} install ok installed"
    box.run(["rmdir", "/var/lib/kibotos/node/runtime/instances/inst-leftover"])
    box.run("systemctl start kibotos-node")
    wait_ready(box)

    # 4. an upgrade whose check passes, with the installed (old) version's binary.
    box.run("systemctl stop kibotos-node")
    out = apt(box, "install /packages/v3/*.deb")
    assert f"with the installed kibotos-node {NEXT[0]}" in out
    assert "check-maintenance --operation upgrade: passed" in out
    assert "trying script from the new package" not in out
    assert version_of(box, "kibotos-common") == f"{NEXT[1]} install ok installed"
    assert box.run("systemctl is-active kibotos-node || true").stdout.strip() == "inactive"
    box.run("systemctl start kibotos-node")
    wait_ready(box)
    assert NEXT[1] in box.run("kibo --version").stdout

    # 5. remove: refused while the node holds the Volume, and the node runs again.
    out = apt(box, "remove kibotos-node", ok=False)
    assert f"detached volume {volume.group(0)} in storage pool pool-a is held" in out
    assert "kibotos-node: not removed" in out
    assert box.run("systemctl is-active kibotos-node").stdout.strip() == "active"
    assert version_of(box, "kibotos-node") == f"{NEXT[1]} install ok installed"
    wait_ready(box)
    box.run(f"kibo volume delete {volume.group(0)}")
    out = apt(box, "remove kibotos-node")
    assert "check-maintenance --operation remove: passed" in out
    assert box.run("systemctl list-units 'kibotos-dataplane-*' 'kibotos-egress-*' "
                   "--all --plain --no-legend").stdout.strip() == ""
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
