"""The man pages debian/manpages.py renders at package build time from the commands'
click trees (click-man), rendered here from this tree's commands (fast, no package
build; the built packages' pages are tests/packaging/test_deb.py's): a page for every
command and subcommand, each top-level page names every subcommand, every page a page
refers to exists, no page name is in two packages, and man renders each without a
warning."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import click
import click_man
import pytest

from kibotos.cli.main import kibo_cli, kibotos_cli

REPO = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
#: The man1 directory of each package, in debian/manpages.py's argument order.
PACKAGES = ("kibotos-common", "kibotos-node", "kibotos-cli")
EPOCH = "1700000000"


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """Package -> page file name -> its text."""
    out = tmp_path_factory.mktemp("man")
    dirs = [out / p for p in PACKAGES]
    site = Path(click_man.__file__).resolve().parents[1]
    env = dict(os.environ, SOURCE_DATE_EPOCH=EPOCH)
    proc = subprocess.run([sys.executable, "-B", str(REPO / "debian/manpages.py"),
                           str(site), *map(str, dirs)], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    return {package: {f.name: f.read_text() for f in directory.glob("*.1")}
            for package, directory in zip(PACKAGES, dirs, strict=True)}


def _subcommands(group: click.Group, name: str) -> list[str]:
    ctx = click.Context(group, info_name=name)
    found = {n: group.get_command(ctx, n) for n in group.list_commands(ctx)}
    return [n for n, command in found.items() if command is not None and not command.hidden]


def _node_group() -> click.Group:
    node = kibotos_cli.get_command(click.Context(kibotos_cli), "node")
    assert isinstance(node, click.Group)
    return node


def test_every_top_level_command_has_a_page_naming_its_subcommands(
        pages: dict[str, dict[str, str]]) -> None:
    for package, name, group in (("kibotos-common", "kibotos", kibotos_cli),
                                 ("kibotos-node", "kibotos-node", _node_group()),
                                 ("kibotos-cli", "kibo", kibo_cli)):
        page = pages[package][f"{name}.1"]
        assert page.startswith(f'.TH "{name.upper()}" "1" "2023-11-14"'), page[:80]
        commands = page[page.index(".SH COMMANDS"):]
        subcommands = _subcommands(group, name)
        assert len(subcommands) >= 4, subcommands
        for sub in subcommands:
            assert f"\\fB{sub}\\fP" in commands, (name, sub)
            # Its own page is in the same package ("kibotos node" is kibotos-node's).
            owner = "kibotos-node" if (name, sub) == ("kibotos", "node") else package
            assert f"{name}-{sub}.1" in pages[owner], (name, sub)


def test_every_subcommand_has_a_page_and_every_reference_resolves(
        pages: dict[str, dict[str, str]]) -> None:
    every = [n for p in pages.values() for n in p]
    assert len(every) == len(set(every)), "a page name in two packages"
    assert "kibo-workspace-create.1" in pages["kibotos-cli"]
    assert "kibotos-node-check-maintenance.1" in pages["kibotos-node"]
    assert "kibotos-ctrl-serve.1" in pages["kibotos-common"]
    for package, found in pages.items():
        for name, text in found.items():
            for ref in re.findall(r"\\fB([a-z0-9-]+)\(1\)\\fP", text):
                assert f"{ref}.1" in every, (package, name, ref)
            # Each page's own help: the command's DESCRIPTION is not empty.
            assert re.search(r"\.SH DESCRIPTION\n\S", text), (package, name)


def test_man_renders_every_page_without_a_warning(pages: dict[str, dict[str, str]],
                                                  tmp_path: Path) -> None:
    if shutil.which("man") is None:
        if IN_CI:
            pytest.fail("man missing (man-db)")
        pytest.skip("man not installed")
    for found in pages.values():
        for name, text in found.items():
            path = tmp_path / name
            path.write_text(text)
            proc = subprocess.run(["man", "--warnings", "-E", "UTF-8", "-l", "-Tutf8", "-Z",
                                   str(path)], env=dict(os.environ, MANWIDTH="80"),
                                  capture_output=True, text=True, timeout=60, check=False)
            assert proc.returncode == 0, (name, proc.stderr)
            assert proc.stderr == "", (name, proc.stderr)
