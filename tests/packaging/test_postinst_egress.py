"""The node package's postinst of the source tree makes the egress account (``kibotos-egress``) like
the VMM account: a system user and group, no home, no shell, idempotent, and an
account the operator made is kept.  Run against a private copy of /etc in a private
mount namespace, so the host's accounts stay as they are (no package build needed:
the source script is what dpkg ships, with debhelper's additions after it)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
POSTINST = ROOT / "debian" / "kibotos-node.postinst"
ACCOUNTS = ("kibotos-vmm", "kibotos-egress")
CLEAN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}

pytestmark = pytest.mark.root


def private_etc(tmp: Path, extra_group: str = "") -> Path:
    etc = tmp / "etc"
    shutil.copytree("/etc", etc, symlinks=True)
    for name in ("group", "gshadow", "passwd", "shadow"):
        path = etc / name
        if path.exists():
            kept = [ln for ln in path.read_text().splitlines(keepends=True)
                    if ln.split(":")[0] not in ACCOUNTS]
            path.write_text("".join(kept))
    if extra_group:
        with open(etc / "group", "a") as f:
            f.write(extra_group)
    return etc


def postinst(etc: Path) -> subprocess.CompletedProcess[str]:
    script = 'mount --bind "$1" /etc && exec sh "$2" configure'
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           script, "sh", str(etc), str(POSTINST)], env=CLEAN_ENV,
                          capture_output=True, text=True, timeout=120, check=False)


def entries(etc: Path, name: str) -> dict[str, list[str]]:
    return {ln.split(":")[0]: ln.split(":") for ln in (etc / name).read_text().splitlines()
            if ln}


def host_lines() -> list[str]:
    return [ln for name in ("group", "passwd")
            for ln in (Path("/etc") / name).read_text().splitlines()
            if ln.split(":")[0] in ACCOUNTS]


def test_postinst_creates_the_egress_account_idempotently(tmp_path: Path) -> None:
    if shutil.which("useradd", path=CLEAN_ENV["PATH"]) is None:
        pytest.skip("no useradd")
    host = host_lines()
    etc = private_etc(tmp_path)
    proc = postinst(etc)
    assert proc.returncode == 0, proc.stderr
    user = entries(etc, "passwd")["kibotos-egress"]
    group = entries(etc, "group")["kibotos-egress"]
    assert int(user[2]) < 1000, user  # a system account
    assert int(user[3]) == int(group[2]), (user, group)
    assert user[5:7] == ["/nonexistent", "/usr/sbin/nologin"], user
    assert group[3] == "", group  # nobody else is in its group
    before = {n: (etc / n).read_bytes() for n in ("group", "gshadow", "passwd", "shadow")}
    proc = postinst(etc)
    assert proc.returncode == 0, proc.stderr
    assert {n: (etc / n).read_bytes() for n in before} == before
    assert host_lines() == host


def test_postinst_keeps_an_egress_group_the_operator_made(tmp_path: Path) -> None:
    etc = private_etc(tmp_path, extra_group="kibotos-egress:x:4343:\n")
    proc = postinst(etc)
    assert proc.returncode == 0, proc.stderr
    assert entries(etc, "group")["kibotos-egress"][2] == "4343"
    assert entries(etc, "passwd")["kibotos-egress"][3] == "4343"
