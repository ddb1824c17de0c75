"""docs/cli.md stays true for `kibo template`: every command and option is in it, and
its examples are what kibo prints for the same answers from ctrl."""

from __future__ import annotations

from pathlib import Path

import click

from kibotos.cli.main import kibo_cli

DOC = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()

TEMPLATE = {
    "name": "kibotos-base",
    "image": {"digest": "sha256:3f9a1c0d7e52b8a4" + "0" * 48, "size": 247463936},
    "kernel_digest": "sha256:a1b2c3d4e5f60718" + "1" * 48,
    "initramfs_digest": "sha256:9c8b7a6f5e4d3c2b" + "2" * 48,
    "source": {"kind": "recipe", "inputs_digest": "5" * 64,
               "recipe": {"suite": "bookworm", "variant": "minbase",
                          "packages": ["python3"], "mirror": "http://deb.debian.org/debian"},
               "platform": {"inputs_digest": "6" * 64, "kernel": "6.1.0-41-amd64",
                            "initramfs_compression": "gzip"},
               "made_by": "kibo 0.2.0"},
    "created_at": "2026-11-29T15:00:00.000Z", "updated_at": "2026-11-30T09:12:44.310Z",
    "revision": 2,
}


def test_every_template_command_and_option_is_documented():
    group = kibo_cli.get_command(click.Context(kibo_cli), "template")
    assert isinstance(group, click.Group)
    names = group.list_commands(click.Context(group))
    assert set(names) == {"build", "import", "list", "get", "delete"}
    for name in names:
        cmd = group.get_command(click.Context(group), name)
        assert cmd is not None
        assert f"### `kibo template {name}" in DOC, name
        for param in cmd.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert max(param.opts, key=len) in DOC, f"kibo template {name} {param.opts}"


def test_examples_are_what_kibo_prints(kibo, fake_ctrl):
    fake_ctrl.route("GET", "/v1/templates", (200, {"result": {"templates": [TEMPLATE]}}))
    fake_ctrl.route("GET", "/v1/templates/kibotos-base", (200, {"result": TEMPLATE}))
    listed = kibo("template", "list")
    assert listed.exit_code == 0, listed.stderr
    assert f"$ kibo template list\n{listed.stdout}```" in DOC
    shown = kibo("template", "get", "kibotos-base")
    assert shown.exit_code == 0, shown.stderr
    assert f"$ kibo template get kibotos-base\n{shown.stdout}```" in DOC
