"""The options every ``kibo`` command shares, and the one place errors become exit codes.

`kibo_options` adds ``--config``, ``--json`` and ``--timeout`` to a command (so they
work after the subcommand, as the spec writes them: ``kibo node drain X --wait
--timeout 10m``) and hands the command an `Invocation` instead.  A `KibotosError`
raised anywhere below is printed by the renderer and ends the process with the error
class's exit code; click's own usage errors keep exit code 2.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kibotos.cli.core import kibo_config
from kibotos.cli.core.client import Client, Deadline
from kibotos.cli.core.numbers import AsciiInt
from kibotos.cli.core.output import Output, Row
from kibotos.core import ids
from kibotos.core.errors import InvalidArgument, KibotosError
from kibotos.core.units import parse_duration
from kibotos.tls.contexts import client_context

if TYPE_CHECKING:  # imported by client_context for an https:// data plane only
    import ssl


class Invocation:
    """One run of one command: where output goes, the deadline, and how to reach ctrl."""

    def __init__(self, *, config_path: str | None, as_json: bool,
                 timeout: float | None) -> None:
        self.explicit_config = config_path
        self.out = Output(as_json)
        self.deadline = Deadline(timeout)
        self._client: Client | None = None
        self._dataplane_tls: ssl.SSLContext | None = None

    @property
    def as_json(self) -> bool:
        return self.out.as_json

    @property
    def config_path(self) -> Path:
        return kibo_config.kibo_config_path(self.explicit_config)

    def load_config(self) -> kibo_config.KiboConfig:
        path = self.config_path
        if not path.exists():
            raise InvalidArgument(
                f"configuration file {path} does not exist: run `kibo enroll` first, or "
                "point --config or KIBO_CONFIG at one")
        return kibo_config.load(path)

    def client(self) -> Client:
        """The client for ctrl, built on first use (so bad arguments never load config)."""
        if self._client is None:
            cfg = self.load_config()
            self._client = Client(cfg.ctrl_urls or cfg.ctrl_url, cfg.credential,
                                  request_timeout=cfg.timeout, deadline=self.deadline,
                                  verify=None if cfg.ctrl_ca is None
                                  else client_context(cfg.ctrl_ca))
        return self._client

    def list_table(self, path: str, key: str, columns: Sequence[str],
                   row: Callable[[dict[str, Any]], Row]) -> None:
        """What a plain list command does: GET `path` and show the items under `key` as
        a table, `row` making each one's cells (with ``--json``, the result as is)."""
        found = self.client().get(path)
        self.out.result(found, lambda: self.out.table(
            columns, [row(item) for item in found.get(key) or []]))

    def dataplane_tls(self, url: str) -> ssl.SSLContext | None:
        """What a data-plane client verifies ``url`` (ctrl's ``dataplane_url``) with: the
        cluster CA ``kibo enroll`` saved (nodes' data-plane certificates chain to it),
        else the system store; None for a plain ``http://`` one (loopback only)."""
        if not url.startswith("https://"):
            return None
        if self._dataplane_tls is None:  # one per invocation: port-forward connects often
            self._dataplane_tls = client_context(self.load_config().cluster_ca)
        return self._dataplane_tls

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def _parse_timeout(value: str | None) -> float | None:
    if value is None:
        return None
    seconds = parse_duration(value, "--timeout")
    if seconds <= 0:
        raise InvalidArgument(f"--timeout must be positive, got {value!r}")
    return seconds


def kibo_options(fn: Callable[..., None]) -> Callable[..., None]:
    """Decorate a click command callback whose first parameter is an `Invocation`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, config_path: str | None, as_json: bool, timeout: str | None,
                **kwargs: Any) -> None:
        out = Output(as_json)
        inv: Invocation | None = None
        try:
            inv = Invocation(config_path=config_path, as_json=as_json,
                             timeout=_parse_timeout(timeout))
            fn(inv, *args, **kwargs)
        except KibotosError as exc:
            out.error(exc)
            raise click.exceptions.Exit(exc.exit_code) from None
        finally:
            if inv is not None:
                inv.close()

    options = [
        click.option("--config", "config_path", metavar="PATH",
                     help="kibo.toml to use (default: $KIBO_CONFIG, then "
                          "~/.config/kibotos/kibo.toml)."),
        click.option("--json", "as_json", is_flag=True,
                     help='Print {"result": ...} as JSON instead of text.'),
        click.option("--timeout", metavar="DURATION",
                     help="Give up after this long in all, e.g. 30s or 10m (exit code 16)."),
    ]
    decorated: Callable[..., None] = wrapper
    for option in reversed(options):
        decorated = option(decorated)
    return decorated


# ------------------------------------------------------------------ shared arguments


def node_id_argument(value: str) -> str:
    """Check a NODE argument before anything is loaded or sent (exit code 10)."""
    return ids.check_node_id(value)


def command_id_option(fn: Callable[..., None]) -> Callable[..., None]:
    return click.option(
        "--command-id", metavar="ID",
        help="Idempotency key: replaying it with the same input returns the stored "
             "result (default: one generated for this invocation).")(fn)


def expected_version_option(fn: Callable[..., None]) -> Callable[..., None]:
    return click.option(
        "--expected-version", type=AsciiInt(min=0), metavar="N",
        help="Refuse the change unless the record is still at this version.")(fn)


def versioned_write_options(fn: Callable[..., None]) -> Callable[..., None]:
    """``--command-id``, ``--expected-version`` and the shared options, in that order:
    what every write of a versioned record takes, declared once so that no such command
    forgets one or lists them in another order."""
    return command_id_option(expected_version_option(kibo_options(fn)))


def new_volume_options(fn: Callable[..., None]) -> Callable[..., None]:
    """``--pool`` and ``--label`` (repeatable) of a command that makes a Volume (``volume
    create``, ``transfer import``); `new_volume_fields` checks them."""
    fn = click.option("--label", "label_items", multiple=True, metavar="KEY=VALUE",
                      help="A label of the new Volume (repeatable).")(fn)
    return click.option("--pool", "pool_id", metavar="POOL",
                        help="Storage pool of the new Volume (default: the nodes' one "
                             "default pool).")(fn)


def new_volume_fields(pool_id: str | None, label_items: tuple[str, ...]) -> dict[str, Any]:
    """The checked ``pool_id`` and ``labels`` of a request that makes a Volume."""
    return {"pool_id": None if pool_id is None else ids.check_pool_id(pool_id),
            "labels": parse_labels(label_items)}


def check_command_id(value: str | None) -> str | None:
    return None if value is None else ids.check_command_id(value)


def parse_labels(items: tuple[str, ...]) -> dict[str, str]:
    """``--label key=value`` options (repeatable) as a mapping; each key once."""
    labels: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidArgument(f"invalid label {item!r}: expected key=value")
        ids.check_label_key(key)
        if not ids.LABEL_VALUE.fullmatch(value):
            raise InvalidArgument(f"invalid value {value!r} of label {key!r}: up to 63 "
                                  "letters, digits and . _ -, starting and ending with a "
                                  "letter or digit")
        if key in labels:
            raise click.UsageError(f"--label {key} is given twice")
        labels[key] = value
    return labels
