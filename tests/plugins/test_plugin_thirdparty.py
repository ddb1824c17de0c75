"""A third-party plugin, installed for real: a throwaway wheel that pip installs into a
temporary directory, found through its entry point like any other distribution."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from kibotos.core.errors import FailedPrecondition
from kibotos.plugins import DISABLE_ENV, BlockedPlugin, load_plugins

ACME = textwrap.dedent("""
    from kibotos.sdk import hookimpl

    class FirstFit:
        name = "acme-first-fit"
        def __init__(self, options): pass
        def rank(self, request, candidates): return [c.node_id for c in candidates]

    @hookimpl
    def kibotos_register_placement(register):
        register(FirstFit)
""")

EVIL = textwrap.dedent("""
    from kibotos.sdk import hookimpl

    @hookimpl
    def kibotos_register_placement(register):
        pass
""")


def build_wheel(directory: Path, dist: str, version: str, module: str, source: str,
                entry_point: str) -> Path:
    """A minimal, valid wheel: one module and a dist-info with an entry point."""
    info = f"{dist.replace('-', '_')}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": source,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: kibotos-tests\n"
                         "Root-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/entry_points.txt": f"[kibotos]\n{entry_point} = {module}\n",
    }

    def digest(data: str) -> str:
        raw = hashlib.sha256(data.encode()).digest()
        return "sha256=" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    record = "".join(f"{n},{digest(d)},{len(d.encode())}\n" for n, d in files.items())
    files[f"{info}/RECORD"] = record + f"{info}/RECORD,,\n"
    wheel = directory / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return wheel


def pip_install(wheel: Path, target: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
         "--disable-pip-version-check", "--target", str(target), str(wheel)],
        check=True,
    )


@pytest.fixture(scope="module")
def acme_site(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("acme")
    site = work / "site"
    pip_install(build_wheel(work, "acme-kibotos", "1.2.3", "acme_kibotos", ACME, "acme"), site)
    return site


@pytest.fixture
def on_path(monkeypatch):
    def add(site: Path) -> None:
        monkeypatch.syspath_prepend(str(site))

    yield add
    for name in ("acme_kibotos", "evil_binpack"):
        sys.modules.pop(name, None)


def test_installed_third_party_plugin_is_found(acme_site, on_path):
    assert (acme_site / "acme_kibotos-1.2.3.dist-info" / "entry_points.txt").exists()
    on_path(acme_site)
    regs = load_plugins()
    info = regs.info("placement", "acme-first-fit")
    assert (info.plugin, info.version, info.source, info.module) == (
        "acme", "1.2.3", "entry-point", "acme_kibotos"
    )
    assert {"acme-first-fit", "binpack", "spread"} <= set(regs.placement.names())
    sources = [i.source for i in regs.infos]
    assert sources.index("entry-point") > max(
        n for n, s in enumerate(sources) if s == "builtin"
    )


def test_third_party_plugin_can_be_blocked_and_is_not_imported(acme_site, on_path, monkeypatch):
    on_path(acme_site)
    sys.modules.pop("acme_kibotos", None)
    monkeypatch.setenv(DISABLE_ENV, "acme")
    regs = load_plugins()
    assert "acme-first-fit" not in regs.placement
    assert BlockedPlugin("acme", "entry-point", "acme_kibotos") in regs.blocked
    assert "acme_kibotos" not in sys.modules


def test_third_party_entry_point_named_like_a_builtin_is_refused(tmp_path, on_path):
    site = tmp_path / "site"
    pip_install(build_wheel(tmp_path, "evil-dist", "6.6.6", "evil_binpack", EVIL, "binpack"),
                site)
    on_path(site)
    with pytest.raises(FailedPrecondition) as err:
        load_plugins()
    assert err.value.message == (
        "duplicate plugin 'binpack': kibotos_binpack (kibotos-builtin-binpack) and "
        "evil_binpack (evil-dist)"
    )


def test_plugins_list_in_a_fresh_process_shows_it(acme_site):
    env = {**os.environ, "PYTHONPATH": str(acme_site)}
    env.pop(DISABLE_ENV, None)
    done = subprocess.run(
        [sys.executable, "-m", "kibotos.cli.main", "plugins", "list", "--json"],
        capture_output=True, text=True, env=env, check=True,
    )
    plugins = json.loads(done.stdout)["result"]["plugins"]
    assert {
        "kind": "placement", "name": "acme-first-fit", "plugin": "acme", "version": "1.2.3",
        "source": "entry-point", "module": "acme_kibotos",
    } in plugins
