"""``kibotos ctrl serve`` and ``kibotos ctrl grant``: the ctrl role on its own host.

``grant`` writes an enrollment grant straight into the store (migrating it first if
ctrl never ran), without going through the API: it is how the first operator gets in,
and it needs nothing but read access to ctrl.toml and write access to the database.
Errors print ``error: <code>: <message>`` on stderr and exit with the error class's
code (a bad configuration file is invalid_argument: 10).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from functools import partial, wraps
from typing import Any

import click

from kibotos import config as config_mod
from kibotos.core.errors import InvalidArgument, KibotosError
from kibotos.core.units import parse_duration


def _fail_cleanly(fn: Callable[..., None]) -> Callable[..., None]:
    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except KibotosError as exc:
            click.echo(f"error: {exc.code}: {exc.message}", err=True)
            sys.exit(exc.exit_code)

    return wrapper


def serve_options(config_help: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """What a role's ``serve`` command takes (``--config FILE``, required, whose help is
    `config_help`; ``--log-level``) and how it fails: one line on stderr and the error
    kind's exit code, never a traceback.  One definition, so every role's serve reads
    alike."""

    def decorate(fn: Callable[..., None]) -> Callable[..., None]:
        fn = _fail_cleanly(fn)
        fn = click.option("--log-level", default="info", show_default=True,
                          type=click.Choice(["debug", "info", "warning", "error"]))(fn)
        return click.option("--config", "config_path", required=True,
                            type=click.Path(dir_okay=False), help=config_help)(fn)

    return decorate


def log_to_stderr(level: str) -> None:
    """A serving role's log: `level` (a ``--log-level`` choice) and up, on stderr, each
    line with its time, level and logger."""
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@click.group("ctrl")
def ctrl_group() -> None:
    """The control plane: serve the API, or issue a grant on the ctrl host."""


@ctrl_group.command("serve")
@serve_options("ctrl.toml")
def serve(config_path: str, log_level: str) -> None:
    """Run ctrl until SIGTERM or SIGINT."""
    import trio

    from kibotos.ctrl.serve import serve_ctrl

    cfg = config_mod.load(config_mod.CtrlConfig, config_path)
    log_to_stderr(log_level)
    trio.run(serve_ctrl, cfg)


@ctrl_group.command("grant")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="ctrl.toml")
@click.option("--kind", required=True, type=click.Choice(["node", "operator"]))
@click.option("--node-id", default=None, help="the node ID (node grants only)")
@click.option("--name", default=None, help="a note shown by `kibo enrollment list`")
@click.option("--expires", default="1h", show_default=True,
              help="lifetime of the grant, e.g. 30m, 8h")
@click.option("--json", "as_json", is_flag=True, help='print {"result": …}')
@_fail_cleanly
def grant(config_path: str, kind: str, node_id: str | None, name: str | None,
          expires: str, as_json: bool) -> None:
    """Issue a one-time enrollment grant by writing ctrl's store directly."""
    from kibotos.ctrl.live.context import utcnow
    from kibotos.ctrl.model import enrollment
    from kibotos.ctrl.store import migrate
    from kibotos.ctrl.store.db import Store, make_engine

    expires_in_s = parse_duration(expires, "--expires")
    if expires_in_s <= 0:
        raise InvalidArgument(f"--expires must be positive, got {expires!r}")
    cfg = config_mod.load(config_mod.CtrlConfig, config_path)
    if not cfg.ctrl.database_url:
        cfg.ctrl.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    engine = make_engine(cfg.database_url)
    try:
        migrate.upgrade(engine)
        store = Store(engine)
        result = store.run_sync(partial(
            enrollment.create_grant, kind=kind, node_id=node_id, name=name,
            expires_in_s=expires_in_s, created_by=None, now=utcnow()))
    finally:
        engine.dispose()
    if as_json:
        click.echo(json.dumps({"result": result}, indent=2))
        return
    click.echo(result["token"])
    what = f"node {node_id}" if kind == "node" else "an operator"
    click.echo(f"grant {result['grant_id']} for {what}, expires {result['expires_at']}; "
               "exchange it once with `kibo enroll` (or the node's enrollment_grant_file)",
               err=True)
