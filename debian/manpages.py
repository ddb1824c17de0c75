"""Man pages of the three commands, rendered at package build time from the commands'
own click trees with click-man: one page per command and subcommand (`kibo.1`,
`kibo-workspace.1`, `kibo-workspace-create.1`, ...), so that `man kibo-workspace-create`
says what `kibo workspace create --help` says, for exactly the code in the package.

    python3 debian/manpages.py CLICK_MAN KIBOTOS_DIR KIBOTOS_NODE_DIR KIBO_DIR

CLICK_MAN is where click-man is imported from: the wheelhouse (its pure-Python wheel is
imported from the zip: a build tool, never installed into the package's venv), a wheel,
or a directory holding the click_man package (a test's own environment);
each *_DIR is the man1 directory of the package that ships that command
(debian/rules).  Run by the package's own venv Python, so the command trees are the
built ones.  The date in the pages is SOURCE_DATE_EPOCH's (dpkg-buildpackage sets it
from debian/changelog), so a rebuild writes the same bytes.

`kibotos node` is the same click group as `kibotos-node`: its pages come from
`kibotos-node` only (they would have the same file names), and `kibotos.1` names it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def write_pages(click_man: str, out: dict[str, Path]) -> list[Path]:
    """Write every page into its package's directory; the paths written."""
    sys.path.insert(0, click_man)
    import click

    from kibotos.cli.main import kibo_cli, kibotos_cli

    node = kibotos_cli.get_command(click.Context(kibotos_cli), "node")
    assert isinstance(node, click.Group)
    written: list[Path] = []
    # kibotos: its own page and every subcommand's but those of `node`'s tree.
    written += _write_tree(kibotos_cli, "kibotos", None, out["kibotos"], skip={"node"})
    written += _write_tree(node, "kibotos-node", None, out["kibotos-node"], skip=set())
    written += _write_tree(kibo_cli, "kibo", None, out["kibo"], skip=set())
    return written


def _write_tree(command: Any, name: str, parent: Any, directory: Path,
                skip: set[str]) -> list[Path]:
    """The page of `command` and, recursively, of its visible subcommands.

    click-man reads a group's subcommands from its ``commands`` attribute, which a
    kibotos.cli.core.lazy_group.LazyGroup fills only on demand: each group's commands are
    resolved (``get_command`` for every name ``list_commands`` gives) before its page
    is rendered, so the page names all of them."""
    import click
    from click_man.core import generate_man_page  # type: ignore[import-untyped]

    from kibotos._version import __version__

    ctx = click.Context(command, info_name=name, parent=parent)
    children: dict[str, click.Command] = {}
    if isinstance(command, click.Group):
        for sub in command.list_commands(ctx):
            found = command.get_command(ctx, sub)
            if found is not None and not found.hidden:
                children[sub] = found
                command.commands.setdefault(sub, found)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / (ctx.command_path.replace(" ", "-") + ".1")
    path.write_text(generate_man_page(ctx, version=__version__))
    written = [path]
    for sub, child in children.items():
        if sub not in skip:
            written += _write_tree(child, sub, ctx, directory, skip=set())
    return written


def main(argv: list[str]) -> int:
    if len(argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    click_man = Path(argv[1])
    if click_man.is_dir() and not (click_man / "click_man").is_dir():
        wheels = sorted(click_man.glob("click_man-*.whl"))
        if not wheels:
            print(f"manpages: no click_man wheel in {click_man}", file=sys.stderr)
            return 1
        click_man = wheels[-1]
    out = {"kibotos": Path(argv[2]), "kibotos-node": Path(argv[3]), "kibo": Path(argv[4])}
    written = write_pages(str(click_man), out)
    print(f"manpages: {len(written)} pages", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
