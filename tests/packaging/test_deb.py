"""The Debian packages by role (docs/packaging.md): built from a clean copy of HEAD with
packaging/deb/build.sh (tests/packaging/conftest.py), then checked from the outside.

* control fields and conffiles of each package (`dpkg-deb -f`, the control archive);
* the file list of all six together: the three commands as links into the venv,
  every built-in plugin, the guest agent files the node's runtime installations need,
  every unit and slice of contrib/systemd (byte for byte), the example configs,
  nothing naming the build tree; each role's files in its own package;
* the package extracted into a temporary directory (`dpkg-deb -x`, as docs/upgrades.md
  does with the next version) runs: `kibo --version`, `kibotos plugins list`, the bash
  and zsh completion scripts it installs are what its `kibo completion` prints (and
  bash completes through them), the compiled dependencies import, the example configs
  load, and the runtime directory `/usr/lib/kibotos/node` is complete for
  `check-upgrade --runtime-dir`, and the extracted `kibotos-node check-upgrade
  [--preview]` passes on a fresh node, as docs/upgrades.md runs it;
* no byte code in the package, and every module compiles (postinst compiles them);
* the maintainer scripts: the real postinst, run as `postinst configure` in a private
  mount namespace over a copy of /etc (the host's accounts are never touched), creates
  the kibotos-vmm group and user, is idempotent and keeps an account the operator made;
  no script starts, enables or restarts a service, and none stops a slice.

The build takes one to three minutes (most of it pip and dpkg-deb on a busy machine);
its wheelhouse is cached in ~/.cache/kibotos (packaging/deb/build.sh).  Set
KIBOTOS_TEST_DEBS to a directory of built packages to check those instead.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from repack import repack

REPO = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
VENV = "usr/lib/kibotos/venv"
SITE = f"{VENV}/lib/python3.11/site-packages"
ACCOUNT = "kibotos-vmm"
CLEAN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def root(debs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every package's files, extracted (not installed) into one temporary directory,
    as a host with all roles has them."""
    where = tmp_path_factory.mktemp("root")
    for deb in debs.values():
        subprocess.run(["dpkg-deb", "-x", str(deb), str(where)], check=True)
    return where


@pytest.fixture(scope="module")
def control(debs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> dict[str, Path]:
    """Package name -> its extracted control archive."""
    out = {}
    for name, deb in debs.items():
        out[name] = tmp_path_factory.mktemp(f"control-{name}")
        subprocess.run(["dpkg-deb", "-e", str(deb), str(out[name])], check=True)
    return out


def _field(deb: Path, name: str) -> str:
    return subprocess.run(["dpkg-deb", "-f", str(deb), name], capture_output=True,
                          text=True, check=True).stdout.strip()


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run a command of the extracted package with a clean environment, from / (so
    nothing of this checkout or its .venv can be imported by accident)."""
    return subprocess.run(argv, cwd="/", env=CLEAN_ENV, capture_output=True, text=True,
                          timeout=300, check=False)


def _plugins() -> dict[str, str]:
    """Built-in plugins: entry-point name -> module, from plugins/*/pyproject.toml."""
    found = {}
    for pyproject in sorted(REPO.glob("plugins/*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text())
        found.update(data["project"]["entry-points"]["kibotos"])
    assert found
    return found


def _debian_version(pep440: str) -> str:
    for tag in ("dev", "rc", "a", "b"):
        head, sep, num = pep440.rpartition(tag)
        if sep and num.isdigit():
            return f"{head.rstrip('.')}~{tag}{num}"
    return pep440


# ------------------------------------------------------------------ control fields


def _depends(deb: Path) -> set[str]:
    return {d.strip().split(" ")[0] for d in _field(deb, "Depends").split(",")}


def test_control_fields_and_conffiles(debs: dict[str, Path], control: dict[str, Path]
                                      ) -> None:
    from kibotos._version import __version__
    version = _debian_version(__version__)
    for name, deb in debs.items():
        assert _field(deb, "Package") == name
        assert _field(deb, "Version") == version
        assert _field(deb, "Architecture") == ("amd64" if name == "kibotos-common" else "all")
        if not name.endswith("-gateway"):  # the old single package had no gateway
            assert "kibotos" in _field(deb, "Conflicts").split(", "), name
        if name != "kibotos-common":
            assert f"kibotos-common (= {version})" in _field(deb, "Depends"), name
    assert {"python3.11", "libc6"} <= _depends(debs["kibotos-common"])
    assert {"qemu-system-x86", "e2fsprogs", "systemd", "dbus", "passwd"} <= _depends(
        debs["kibotos-node"])
    assert "qemu-system-x86" not in _depends(debs["kibotos-ctrl"])
    assert "debootstrap" in _field(debs["kibotos-cli"], "Recommends")
    conffiles = {name: sorted((c / "conffiles").read_text().split())
                 if (c / "conffiles").exists() else [] for name, c in control.items()}
    assert conffiles == {"kibotos-common": [], "kibotos-cli": [],
                         "kibotos-node": ["/etc/kibotos/node/config.toml"],
                         "kibotos-ctrl": ["/etc/kibotos/ctrl.toml"],
                         "kibotos-e2b-gateway": ["/etc/kibotos/e2b-gateway.toml"],
                         "kibotos-exposure-gateway": ["/etc/kibotos/exposure-gateway.toml"]}
    # kibotos-common breaks every other version of each role package (docs/packaging.md,
    # "Package ordering").
    breaks = _field(debs["kibotos-common"], "Breaks")
    for name in debs:
        if name != "kibotos-common":
            assert f"{name} (<< {version})" in breaks, name
            assert f"{name} (>> {version})" in breaks, name


def test_each_role_package_holds_its_own_files(debs: dict[str, Path]) -> None:
    """The venv only in kibotos-common; units, configs and links by role."""
    def files(name: str) -> set[str]:
        listing = subprocess.run(["dpkg-deb", "-c", str(debs[name])], capture_output=True,
                                 text=True, check=True).stdout
        return {line.split()[5].removeprefix(".") for line in listing.splitlines()
                if not line.startswith("d")}
    common, node, ctrl, cli = (files(n) for n in (
        "kibotos-common", "kibotos-node", "kibotos-ctrl", "kibotos-cli"))
    gateways = [files(f"kibotos-{kind}-gateway") for kind in ("e2b", "exposure")]
    assert any(f.startswith("/usr/lib/kibotos/venv/") for f in common)
    for kind, gateway in zip(("e2b", "exposure"), gateways, strict=True):
        package = f"kibotos-{kind}-gateway"
        assert gateway == {f"/lib/systemd/system/{package}.service",
                           f"/etc/kibotos/{kind}-gateway.toml",
                           f"/usr/share/doc/{package}/changelog.gz",
                           f"/usr/share/doc/{package}/copyright"}, gateway
    for role in (node, ctrl, cli, *gateways):
        assert not any(f.startswith("/usr/lib/kibotos/venv/") for f in role)
    assert "/usr/bin/kibotos" in common
    assert {"/usr/bin/kibotos-node", "/usr/lib/kibotos/node",
            "/lib/systemd/system/kibotos-node.service",
            "/lib/systemd/system/kibotos-vmm.slice"} <= node
    assert "/lib/systemd/system/kibotos-ctrl.service" in ctrl
    assert "/usr/bin/kibo" in cli
    # Shell completion beside each command (click's, generated at build time).
    for files_, cmd in ((common, "kibotos"), (node, "kibotos-node"), (cli, "kibo")):
        assert f"/usr/share/bash-completion/completions/{cmd}" in files_, cmd
        assert f"/usr/share/zsh/vendor-completions/_{cmd}" in files_, cmd
        # Man pages beside each command (debian/manpages.py: one per (sub)command).
        assert f"/usr/share/man/man1/{cmd}.1.gz" in files_, cmd
    assert "/usr/share/man/man1/kibo-workspace-create.1.gz" in cli
    assert "/usr/share/man/man1/kibotos-node-check-upgrade.1.gz" in node
    assert not any(f.startswith("/usr/share/man/man1/kibotos-node") for f in common)
    assert not any(f.startswith("/lib/systemd") for f in cli | common)


def test_debian_version_spelling() -> None:
    assert _debian_version("0.1.0.dev0") == "0.1.0~dev0"
    assert _debian_version("0.2.0a1") == "0.2.0~a1"
    assert _debian_version("1.0.0rc2") == "1.0.0~rc2"
    assert _debian_version("1.2.3") == "1.2.3"


# ------------------------------------------------------------------ file list


def test_commands_link_into_the_venv(root: Path) -> None:
    for cmd in ("kibotos", "kibo", "kibotos-node"):
        link = root / "usr/bin" / cmd
        assert link.is_symlink(), cmd
        assert os.readlink(link) == f"../lib/kibotos/venv/bin/{cmd}"
        assert os.access(link.resolve(), os.X_OK)
    # The venv's interpreter is the system's, by absolute link (an extracted copy runs).
    assert os.readlink(root / VENV / "bin/python3.11") == "/usr/bin/python3.11"
    assert "command" not in (root / VENV / "pyvenv.cfg").read_text()
    # Nothing is ever pip-installed on a host.
    assert not (root / VENV / "bin/pip").exists()
    assert not (root / VENV / "bin/activate").exists()


def test_units_slices_and_configs(root: Path) -> None:
    shipped = sorted(p.name for p in (REPO / "contrib/systemd").iterdir())
    assert {"kibotos-node.service", "kibotos-ctrl.service", "kibotos-vmm.slice"} <= set(shipped)
    assert sorted(p.name for p in (root / "lib/systemd/system").iterdir()) == shipped
    for name in shipped:
        assert ((root / "lib/systemd/system" / name).read_bytes()
                == (REPO / "contrib/systemd" / name).read_bytes()), name
    for conf in ("ctrl.toml", "e2b-gateway.toml", "exposure-gateway.toml"):
        assert (root / "etc/kibotos" / conf).read_bytes() == (
            REPO / "debian/conf" / conf).read_bytes(), conf
    assert (root / "etc/kibotos/node/config.toml").is_file()


def test_every_builtin_plugin_and_the_guest_agent(root: Path) -> None:
    site = root / SITE
    for module in _plugins().values():
        assert (site / module / "__init__.py").is_file(), module
    assert (site / "kibotos/guest/agent.py").is_file()
    def agent_modules(package: Path) -> list[str]:
        return sorted(p.relative_to(package).as_posix() for p in package.rglob("*.py"))
    agent = agent_modules(REPO / "kibotos/guest/kibotos_guest")
    assert "runtime/framing.py" in agent
    assert agent_modules(site / "kibotos/guest/kibotos_guest") == agent
    # The runtime directory check-upgrade is pointed at is the venv's site-packages.
    assert os.readlink(root / "usr/lib/kibotos/node") == "venv/lib/python3.11/site-packages"


def test_no_byte_code_in_the_package(debs: dict[str, Path], root: Path) -> None:
    """Debian's Python policy: postinst compiles, prerm removes; and every module of the
    venv does compile (what postinst will do, here on the extracted copy)."""
    listing = "".join(subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True,
                                     text=True, check=True).stdout for deb in debs.values())
    assert "__pycache__" not in listing
    assert ".pyc" not in listing
    with_pycache = root.parent / (root.name + "-compiled")
    shutil.copytree(root / "usr/lib/kibotos", with_pycache, symlinks=True)
    proc = _run([str(with_pycache / "venv/bin/python3"), "-m", "compileall", "-q",
                 "--invalidation-mode", "checked-hash",
                 str(with_pycache / "venv/lib/python3.11/site-packages")])
    assert proc.returncode == 0, proc.stdout[-3000:]
    shutil.rmtree(with_pycache)


def test_nothing_names_the_build_tree(root: Path) -> None:
    proc = subprocess.run(["grep", "-rlF", "kibotos-deb.", str(root)], capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 1, proc.stdout


def test_every_record_holds_the_shipped_files_hash(root: Path) -> None:
    """Each installed distribution's RECORD names the hash and size of the file the
    package ships (build-venv.sh rewrites them after it changes scripts and strips
    modules): a true RECORD, and one that no longer varies with the build directory,
    which kept two builds of one revision from being byte-identical."""
    import base64
    import csv
    import hashlib

    site = root / SITE
    checked = 0
    for record in sorted(site.glob("*.dist-info/RECORD")):
        with open(record, newline="") as f:
            for name, digest, size in (row for row in csv.reader(f) if len(row) == 3):
                if not digest:
                    continue  # RECORD itself
                path = site / name
                assert path.exists() or path.is_symlink(), f"{record}: {name} is not shipped"
                if path.is_symlink():
                    continue
                data = path.read_bytes()
                ours = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
                assert (digest, size) == ("sha256=" + ours.decode(), str(len(data))), name
                checked += 1
    assert checked > 1000


def test_lintian_is_clean(debs: dict[str, Path]) -> None:
    """Every tag lintian reports is overridden (debian/*.lintian-overrides say why),
    except the placeholder maintainer address, which the release sets."""
    if shutil.which("lintian", path=CLEAN_ENV["PATH"]) is None:
        if IN_CI:
            pytest.fail("lintian missing (packaging/apt-test-deps.txt)")
        pytest.skip("lintian not installed")
    proc = subprocess.run(["lintian", "--allow-root", *map(str, debs.values())],
                          capture_output=True, text=True, timeout=600, check=False,
                          env=CLEAN_ENV)
    tags = [ln for ln in proc.stdout.splitlines()
            if ln[:2] in ("E:", "W:") and "bogus-mail-host" not in ln]
    assert tags == [], proc.stdout


# ------------------------------------------------------------------ the extracted package runs


def test_extracted_commands_run(root: Path) -> None:
    from kibotos._version import __version__
    proc = _run([str(root / "usr/bin/kibo"), "--version"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"kibo, version {__version__}"
    proc = _run([str(root / "usr/bin/kibotos"), "plugins", "list"])
    assert proc.returncode == 0, proc.stderr
    for name in _plugins():
        assert f" {name} " in proc.stdout, (name, proc.stdout)
    proc = _run([str(root / "usr/bin/kibotos-node"), "--help"])
    assert proc.returncode == 0, proc.stderr
    assert "check-upgrade" in proc.stdout


def test_shell_completion_is_installed_as_kibo_prints_it(root: Path) -> None:
    """docs/cli.md: bash-completion loads completions/kibo on the first TAB after
    ``kibo``, zsh finds _kibo in vendor-completions; both are what the packaged kibo
    prints, and the bash one completes through the extracted kibo."""
    paths = {"bash": root / "usr/share/bash-completion/completions/kibo",
             "zsh": root / "usr/share/zsh/vendor-completions/_kibo"}
    for shell, path in paths.items():
        proc = _run([str(root / "usr/bin/kibo"), "completion", shell])
        assert proc.returncode == 0, proc.stderr
        assert path.read_text() == proc.stdout, shell
    assert paths["zsh"].read_text().startswith("#compdef kibo\n")
    script = (f"source {paths['bash']}\nCOMP_WORDS=(kibo node l)\nCOMP_CWORD=2\n"
              "_kibo_completion kibo l node\nprintf '%s\\n' \"${COMPREPLY[@]}\"\n")
    env = {**CLEAN_ENV, "PATH": f"{root / 'usr/bin'}:{CLEAN_ENV['PATH']}"}
    proc = subprocess.run(["bash", "-c", script], cwd="/", env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert (proc.returncode, proc.stdout) == (0, "list\n"), proc.stderr


def test_extracted_venv_is_self_contained(root: Path, revision: str) -> None:
    """The venv's own interpreter imports kibotos and the compiled dependencies from the
    extracted tree, and the package's code accepts its example configs and finds its
    runtime directory complete."""
    node_dir = root / "usr/lib/kibotos/node"
    code = f"""
import sys, kibotos, psycopg, zstandard, pydantic_core, cysystemd.journal, cysystemd.reader
import cryptography.hazmat.bindings._rust, sqlalchemy.engine._row_cy, markupsafe._speedups
import _cffi_backend
from pathlib import Path
from kibotos import config
from kibotos.node.runtime import installations
assert sys.prefix == {str(root / VENV)!r}, sys.prefix
assert kibotos.__file__.startswith({str(root / SITE)!r}), kibotos.__file__
config.load(config.CtrlConfig, {str(root / "etc/kibotos/ctrl.toml")!r})
from kibotos.gateway.e2b.config import GatewayConfig
config.load(GatewayConfig, {str(root / "etc/kibotos/e2b-gateway.toml")!r})
from kibotos.gateway.exposure.config import ExposureConfig
config.load(ExposureConfig, {str(root / "etc/kibotos/exposure-gateway.toml")!r})
node = config.load(config.NodeConfig, {str(root / "etc/kibotos/node/config.toml")!r})
assert node.supervisor.backend == "systemd", node.supervisor
names = installations.required_files()
assert len(names) > 5, names
assert installations.missing_files(Path({str(node_dir)!r}), names) == []
assert installations.default_runtime_dir() == Path({str(node_dir)!r}).resolve()
print(kibotos._version.SOURCE_REVISION)
"""
    proc = _run([str(root / VENV / "bin/python3"), "-c", code])
    assert proc.returncode == 0, proc.stderr
    if not os.environ.get("KIBOTOS_TEST_DEBS"):
        assert proc.stdout.strip() == revision


def test_extracted_check_upgrade_runs_as_docs_upgrades_says(root: Path, tmp_path: Path) -> None:
    """docs/upgrades.md step 2/5: the *next* version's kibotos-node, run from where it
    was extracted, checks a node against its own runtime directory."""
    config = tmp_path / "node.toml"
    config.write_text(f"""
[node]
id = "node-a"
ctrl_url = "http://127.0.0.1:9"
[storage]
root = "{tmp_path / 'root'}"
[resources]
cpu = 1
memory = "1G"
[supervisor]
backend = "direct"
""")
    runtime = root / "usr/lib/kibotos/node"
    for extra in ([], ["--preview"]):
        proc = _run([str(root / "usr/bin/kibotos-node"), "check-upgrade", "--config",
                     str(config), "--runtime-dir", str(runtime), *extra])
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"ok: target runtime directory {runtime} has the" in proc.stdout
        assert "passed" in proc.stdout.splitlines()[-1]


# ------------------------------------------------------------------ maintainer scripts


def _scripts(control: dict[str, Path]) -> dict[tuple[str, str], str]:
    """(package, script) -> the script's commands, without their comments."""
    return {(pkg, p.name): "\n".join(ln for ln in p.read_text().splitlines()
                                     if not ln.lstrip().startswith("#"))
            for pkg, c in control.items() for p in c.iterdir()
            if p.name in ("preinst", "postinst", "prerm", "postrm")}


def test_scripts_never_start_enable_or_stop_slices(control: dict[str, Path]) -> None:
    scripts = _scripts(control)
    for key, text in scripts.items():
        assert ".slice" not in text, key
        assert re.search(r"systemctl .*(start|enable)", text) is None, key
        for verb in ("restart", "try-restart"):
            assert f"deb-systemd-invoke {verb}" not in text, (key, verb)
        # `enable` only re-creates links of a unit the operator had enabled before.
        for line in text.splitlines():
            if "deb-systemd-helper enable" in line:
                assert line.strip().startswith("deb-systemd-helper enable"), line
        assert "was-enabled" in text or "deb-systemd-helper enable" not in text, key
    # The one start: a refused `remove` puts back the node it stopped for the check.
    starts = [k for k, t in scripts.items() if "deb-systemd-invoke start" in t]
    assert starts == [("kibotos-node", "prerm")], starts
    prerm = scripts[("kibotos-node", "prerm")]
    refused = prerm[prerm.index("if ! check remove"):]
    assert prerm.count("deb-systemd-invoke start") == 1
    assert refused.index("deb-systemd-invoke start") < refused.index("exit 1")
    assert "compileall" in scripts[("kibotos-common", "postinst")]
    assert "__pycache__" in scripts[("kibotos-common", "prerm")]
    stops = sorted(k for k, t in scripts.items() if "deb-systemd-invoke stop" in t)
    assert stops == [("kibotos-ctrl", "prerm"), ("kibotos-e2b-gateway", "prerm"),
                     ("kibotos-exposure-gateway", "prerm"), ("kibotos-node", "prerm")], stops
    # The spec's checks, with the installed binary.
    for operation in ("upgrade", "remove"):
        assert f"check {operation}" in prerm, operation
    assert "check-maintenance --config \"$CONFIG\" --operation" in prerm
    # Purge never touches the state: the store, identities and Workspace data.
    for (pkg, name), text in scripts.items():
        if name == "postrm":
            assert "/var/lib/kibotos" not in text, pkg


def _host_account() -> list[str]:
    """The host's kibotos-vmm entries (compared before and after: other jobs on the
    machine may change other lines of these files meanwhile)."""
    return [ln for name in ("group", "passwd")
            for ln in (Path("/etc") / name).read_text().splitlines()
            if ln.startswith(f"{ACCOUNT}:")]


def _private_etc(tmp: Path, *, group_extra: str = "") -> Path:
    """A copy of /etc without any kibotos-vmm account, with a kvm group."""
    etc = tmp / "etc"
    shutil.copytree("/etc", etc, symlinks=True)
    for name in ("group", "gshadow", "passwd", "shadow"):
        f = etc / name
        if f.exists():
            lines = [ln for ln in f.read_text().splitlines(keepends=True)
                     if not ln.startswith(f"{ACCOUNT}:")]
            f.write_text("".join(lines))
    group = (etc / "group").read_text()
    if not any(ln.startswith("kvm:") for ln in group.splitlines()):
        group += "kvm:x:3991:\n"
    (etc / "group").write_text(group + group_extra)
    if group_extra and (etc / "gshadow").exists():
        gname = group_extra.split(":")[0]
        with open(etc / "gshadow", "a") as f:
            f.write(f"{gname}:!::\n")
    return etc


def _postinst(control: Path, etc: Path) -> subprocess.CompletedProcess[str]:
    """`postinst configure` in a private mount namespace: the copy of /etc is bound over
    /etc and a tmpfs over /var/lib/systemd (deb-systemd-helper's state), so the host's
    accounts and unit state stay as they are."""
    script = ('mount --bind "$1" /etc && mount -t tmpfs tmpfs /var/lib/systemd '
              '&& exec "$2" configure')
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           script, "sh", str(etc), str(control / "postinst")],
                          env=CLEAN_ENV, capture_output=True, text=True, timeout=120,
                          check=False)


def _entries(etc: Path, name: str) -> dict[str, list[str]]:
    return {ln.split(":")[0]: ln.split(":") for ln in (etc / name).read_text().splitlines()
            if ln}


@pytest.mark.root
def test_postinst_creates_the_vmm_account_idempotently(control: dict[str, Path],
                                                      tmp_path: Path) -> None:
    host = _host_account()
    etc = _private_etc(tmp_path)
    proc = _postinst(control["kibotos-node"], etc)
    assert proc.returncode == 0, proc.stderr
    group = _entries(etc, "group")[ACCOUNT]
    user = _entries(etc, "passwd")[ACCOUNT]
    gid = int(group[2])
    assert gid < 1000, group                      # a system group
    assert int(user[2]) < 1000, user
    assert int(user[3]) == gid, user
    assert user[5] == "/nonexistent", user
    assert user[6] == "/usr/sbin/nologin", user
    assert ACCOUNT in _entries(etc, "group")["kvm"][3].split(","), _entries(etc, "group")["kvm"]
    assert not Path("/nonexistent").exists()
    # Again (a reinstall, an upgrade): nothing changes.
    before = {n: (etc / n).read_bytes() for n in ("group", "gshadow", "passwd", "shadow")}
    proc = _postinst(control["kibotos-node"], etc)
    assert proc.returncode == 0, proc.stderr
    assert {n: (etc / n).read_bytes() for n in before} == before
    assert _host_account() == host


@pytest.mark.root
def test_postinst_keeps_an_account_the_operator_made(control: dict[str, Path],
                                                    tmp_path: Path) -> None:
    etc = _private_etc(tmp_path, group_extra=f"{ACCOUNT}:x:4242:\n")
    proc = _postinst(control["kibotos-node"], etc)
    assert proc.returncode == 0, proc.stderr
    assert _entries(etc, "group")[ACCOUNT][2] == "4242"
    assert _entries(etc, "passwd")[ACCOUNT][3] == "4242"


# ------------------------------------------------------------------ a real dpkg run


def _overlay_run(tmp: Path, command: str) -> subprocess.CompletedProcess[str]:
    """Run `command` (sh) chrooted into an overlay of the host's root file system: the
    host's / is the read-only lower layer, `tmp/upper` takes every write (dpkg's
    database, /etc, /usr), so dpkg really installs, upgrades, removes and purges the
    package, with the dependencies the host has, and the host stays as it is.  A tmpfs
    over /run makes the maintainer scripts see no running systemd.  The upper layer
    persists between calls."""
    upper, work, merged = tmp / "upper", tmp / "work", tmp / "merged"
    for d in (upper, work, merged):
        d.mkdir(exist_ok=True)
    script = (f"mount -t overlay overlay -o lowerdir=/,upperdir={upper},workdir={work} "
              f"{merged} && mount --rbind /dev {merged}/dev && mount --rbind /proc "
              f"{merged}/proc && mount -t tmpfs tmpfs {merged}/run && "
              f'exec chroot {merged} sh -ec "$1"')
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           script, "sh", command],
                          env=dict(CLEAN_ENV, DEBIAN_FRONTEND="noninteractive"),
                          capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.root
def test_dpkg_install_reinstall_remove_purge(debs: dict[str, Path], tmp_path: Path) -> None:
    """No systemd booted (as in a chroot or piuparts): the node's prerm still runs its
    check, which passes for a node that never ran.  With a booted systemd:
    test_deb_in_systemd.py."""
    host = _host_account()
    deb = " ".join(str(d) for d in debs.values())
    names = " ".join(debs)
    had_etc = Path("/etc/kibotos").exists()
    assert not Path("/usr/lib/kibotos").exists()

    def run(command: str) -> str:
        proc = _overlay_run(tmp_path, command)
        assert proc.returncode == 0, (command, proc.stdout[-3000:], proc.stderr[-3000:])
        return proc.stdout

    run(f"dpkg -i {deb}")
    out = run("kibo --version; getent passwd kibotos-vmm; "
              "dpkg-query -W -f='${Status}' kibotos-node")
    assert "kibo, version" in out
    assert "kibotos-vmm:" in out
    assert "install ok installed" in out
    site = "/usr/lib/kibotos/venv/lib/python3.11/site-packages"
    run(f"test -d {site}/kibotos/__pycache__")            # postinst compiled the venv
    # Nothing was enabled (the operator does it).
    run("! ls /etc/systemd/system/*.wants/kibotos-* 2>/dev/null")

    # The operator edits the node's configuration; a reinstall keeps it.
    run("sed -i 's/^id = \"node-a\"/id = \"node-7\"/' /etc/kibotos/node/config.toml")
    run(f"dpkg -i {deb}")
    assert 'id = "node-7"' in run("cat /etc/kibotos/node/config.toml")

    # Remove: the programs go, byte code included (prerm), the configuration stays.
    out = run("echo kgr-x.y > /etc/kibotos/node/grant && "
              f"echo ca > /etc/kibotos/node/ctrl-ca.crt && dpkg -r {names} 2>&1")
    assert "check-maintenance --operation remove: passed" in out
    run("test ! -e /usr/lib/kibotos && test ! -e /usr/bin/kibo && "
        "test ! -e /lib/systemd/system/kibotos-node.service")
    assert 'id = "node-7"' in run("cat /etc/kibotos/node/config.toml")
    # Purge: the configuration, the grant and the CA copy go; the account stays (it owns
    # pool files).
    run(f"dpkg -P {names}")
    run("test ! -e /etc/kibotos && getent group kibotos-vmm >/dev/null")

    # The host saw none of it.
    assert _host_account() == host
    assert not Path("/usr/lib/kibotos").exists()
    assert Path("/etc/kibotos").exists() == had_etc
    query = subprocess.run(["dpkg-query", "-W", "-f=${Status}\n", *debs],
                           capture_output=True, text=True, check=False)
    assert "installed" not in query.stdout.replace("not-installed", "")


@pytest.mark.root
def test_dpkg_auto_deconfigure_checks_with_the_installed_binary(debs: dict[str, Path],
                                                                tmp_path: Path) -> None:
    """`dpkg --auto-deconfigure -i` with kibotos-common first (docs/packaging.md, "Package
    ordering"): its Breaks make dpkg deconfigure kibotos-node before unpacking it, the
    real prerm's `deconfigure` runs the upgrade check with the installed binary then,
    and its `prerm upgrade` later finds kibotos-common replaced and lets the upgrade
    go on.  No systemd booted, a node that never ran: the check passes."""
    from kibotos._version import __version__
    repack(debs, tmp_path / "next", "0.1.1")
    installed = " ".join(str(d) for d in debs.values())
    following = sorted((tmp_path / "next").glob("*.deb"),
                       key=lambda d: not d.name.startswith("kibotos-common_"))
    work = tmp_path / "overlay"
    work.mkdir()

    def run(command: str) -> str:
        proc = _overlay_run(work, command)
        assert proc.returncode == 0, (command, proc.stdout[-4000:], proc.stderr[-3000:])
        return proc.stdout

    run(f"dpkg -i {installed}")
    out = run("dpkg --auto-deconfigure -i " + " ".join(map(str, following)) + " 2>&1")
    deconfigured = out.index("De-configuring kibotos-node")
    checked = out.index("check-maintenance --operation upgrade with the installed "
                        f"kibotos-node {__version__}")
    unpacked = out.index("Unpacking kibotos-common (0.1.1)")
    assert deconfigured < checked < unpacked, out
    assert "check-maintenance --operation upgrade: passed" in out
    assert "kibotos-common is already replaced" in out
    status = run("dpkg-query -W -f='${Package} ${Version} ${Status}\\n' " + " ".join(debs))
    assert status.count("0.1.1 install ok installed") == len(debs), status

