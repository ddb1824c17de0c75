"""docs/cli.md stays true: every command, every option and every exit code is in it."""

from __future__ import annotations

import re
from pathlib import Path

import click

from kibotos.cli.main import kibo_cli
from kibotos.core.errors import ERROR_CLASSES

DOC = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()


def _commands(group: click.Group, prefix: tuple[str, ...] = ()):
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        assert cmd is not None
        path = (*prefix, name)
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, path)
        else:
            yield path, cmd


KIBO_GROUPS = {"enroll", "enrollment", "node"}


def test_every_command_and_option_is_documented():
    ctx = click.Context(kibo_cli)
    for name in KIBO_GROUPS:
        assert name in kibo_cli.list_commands(ctx)
    found = 0
    for path, cmd in _commands(kibo_cli):
        if path[0] not in KIBO_GROUPS:
            continue  # groups owned and documented elsewhere
        found += 1
        words = " ".join(path)
        if len(path) == 3 and path[1] == "overcommit":
            assert f"kibo node overcommit {path[2]}" in DOC, words
        else:
            assert f"kibo {words}" in DOC, words
        for param in cmd.params:
            if isinstance(param, click.Option) and not param.hidden:
                flag = max(param.opts, key=len)
                assert flag in DOC, f"kibo {words} {flag}"
    assert found >= 12


def test_every_exit_code_is_in_the_table():
    table = {}
    for line in DOC.splitlines():
        m = re.match(r"\| (\d+) \|([^|]*)\|", line)
        if m:
            table[int(m.group(1))] = m.group(2)
    for code, cls in ERROR_CLASSES.items():
        assert f"`{code}`" in table.get(cls.exit_code, ""), (code, cls.exit_code)
    assert 2 in table


def test_examples_are_what_kibo_prints(kibo, fake_ctrl):
    from cli_nodes import USAGE, node, offline, over

    fake_ctrl.route("GET", "/v1/nodes", (200, {"result": {
        "nodes": [node(), offline(), over()], "next_page_token": None}}))
    fake_ctrl.route("GET", "/v1/nodes/node-a", (200, {"result": node(host_usage=USAGE)}))
    assert f"$ kibo node list --wide\n{kibo('node', 'list', '--wide').stdout}```" in DOC
    assert f"$ kibo node get node-a\n{kibo('node', 'get', 'node-a').stdout}```" in DOC
