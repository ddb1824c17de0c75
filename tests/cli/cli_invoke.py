"""Running `kibo` in-process the way every CLI test does (pinned width, ASCII tables)."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner, Result

from kibotos.cli.main import kibo_cli


def invoke(config: Path | None, *args: str, input: str | None = None,
           env: dict[str, str] | None = None) -> Result:
    runner = CliRunner()
    full_env = {"COLUMNS": "200", "KIBO_ASCII": "1", "KIBO_CONFIG": None,
                "XDG_CONFIG_HOME": str(config.parent / "xdg") if config else None}
    if config is not None:
        full_env["KIBO_CONFIG"] = str(config)
    full_env.update(env or {})
    return runner.invoke(kibo_cli, list(args), input=input, env=full_env,
                         catch_exceptions=False)
