"""``kibo egress`` and ``kibo resolver`` (docs/network.md, docs/cli.md), and the network
policy flags of ``kibo workspace create`` and ``set-network``.

Every argument is checked here before the config is read or anything is sent, with
the rules ctrl applies (names: the Template name rule; ``HOST:PORT``: `kibotos.
endpoints`; CIDRs: `kibotos.core.cidrs`), so a typo is exit 10 naming the option.  A
password is read from a file (``--password-file``, ``-`` for stdin), never from the
command line, where any user of the host could read it in the process list; and it is
sent only over TLS or to a ctrl on this host's loopback.
"""

from __future__ import annotations

import ipaddress
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click

from kibotos import endpoints
from kibotos.cli.core.client import resource_path
from kibotos.cli.core.options import (
    Invocation,
    check_command_id,
    command_id_option,
    kibo_options,
    versioned_write_options,
)
from kibotos.cli.core.output import Row, Section, dash, yes_no
from kibotos.core import cidrs, ids
from kibotos.core.errors import FailedPrecondition, InvalidArgument

#: RFC 1929's limit, as ctrl checks it.
MAX_CREDENTIAL_BYTES = 255
EGRESS_COLUMNS = ("NAME", "ADDRESS", "AUTHENTICATED", "USERNAME", "REVISION", "UPDATED")
RESOLVER_COLUMNS = ("NAME", "UPSTREAM", "VIA EGRESS", "REVISION", "UPDATED")


def _checked(check: Callable[[], Any]) -> Any:
    try:
        return check()
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def egress_name(value: str, what: str = "egress name") -> str:
    return ids.check_resource_name(value, what)


def resolver_name(value: str, what: str = "resolver name") -> str:
    return ids.check_resource_name(value, what)


def socks_address(value: str) -> str:
    return str(_checked(lambda: endpoints.canonical(value, "--address")))


def upstream_endpoint(value: str) -> str:
    return str(_checked(lambda: endpoints.canonical(value, "--upstream", default_port=53)))


def cidr(value: str, option: str) -> str:
    return str(_checked(lambda: cidrs.parse_network(value, option)))


def read_password(path: str) -> str:
    """The password in `path` (``-``: stdin), one trailing line break dropped."""
    try:
        raw = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"--password-file {path}: {exc.strerror}") from None
    for end in (b"\r\n", b"\n"):
        if raw.endswith(end):
            raw = raw[:-len(end)]
            break
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise InvalidArgument(f"--password-file {path}: not UTF-8 text") from None
    if not 1 <= len(raw) <= MAX_CREDENTIAL_BYTES:
        raise InvalidArgument(f"--password-file {path}: the password must be 1-"
                              f"{MAX_CREDENTIAL_BYTES} bytes")
    return text


def refuse_clear_text(inv: Invocation) -> None:
    """A password goes only over TLS, or to ctrl on this host's loopback."""
    url = urlsplit(inv.load_config().ctrl_url)
    host = url.hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if url.scheme != "https" and not loopback:
        raise FailedPrecondition(
            f"refusing to send a password to ctrl at {url.scheme}://{url.netloc} in clear "
            "text: use an https:// ctrl_url (or run the command on the ctrl host)")


def _credentials(username: str | None, password_file: str | None) -> dict[str, Any]:
    if (username is None) != (password_file is None):
        raise click.UsageError("--username and --password-file go together")
    if username is None:
        return {}
    if not 1 <= len(username.encode()) <= MAX_CREDENTIAL_BYTES:
        raise InvalidArgument(f"--username must be 1-{MAX_CREDENTIAL_BYTES} bytes")
    assert password_file is not None
    return {"username": username, "password": read_password(password_file)}


# ------------------------------------------------------------------ policy flags


def policy_options(fn: Callable[..., None]) -> Callable[..., None]:
    """The network policy flags of ``workspace create`` and ``set-network``."""
    for option in reversed([
        click.option("--allow-out", "allow_out", multiple=True, metavar="CIDR",
                     help="A destination allowed even if --deny-out covers it "
                          "(address or CIDR; repeatable)."),
        click.option("--deny-out", "deny_out", multiple=True, metavar="CIDR",
                     help="A destination refused (address or CIDR; repeatable)."),
        click.option("--no-public-egress", is_flag=True,
                     help="No public egress: only --allow-out destinations, DNS and the "
                          "Egress are reached."),
        click.option("--egress", "egress", metavar="NAME",
                     help="Send the guest's TCP through this Egress (SOCKS5)."),
        click.option("--resolver", "resolver", metavar="NAME",
                     help="Send the guest's DNS to this Resolver."),
    ]):
        fn = option(fn)
    return fn


def policy_from_flags(allow_out: tuple[str, ...], deny_out: tuple[str, ...],
                      no_public_egress: bool, egress: str | None,
                      resolver: str | None) -> dict[str, Any]:
    return {"public_egress": not no_public_egress,
            "allow_out": [cidr(v, "--allow-out") for v in allow_out],
            "deny_out": [cidr(v, "--deny-out") for v in deny_out],
            "egress": None if egress is None else egress_name(egress, "--egress"),
            "resolver": None if resolver is None else resolver_name(resolver, "--resolver")}


def any_policy_flag(allow_out: tuple[str, ...], deny_out: tuple[str, ...],
                    no_public_egress: bool, egress: str | None, resolver: str | None) -> bool:
    return bool(allow_out or deny_out or no_public_egress or egress is not None
                or resolver is not None)


def describe_policy(policy: dict[str, Any] | None) -> str:
    """A policy (stored or in force) in one line; None is the deployment default."""
    if policy is None:
        return "default (the network the node provides)"
    parts = ["public egress " + ("on" if policy.get("public_egress") else "off")]
    if policy.get("allow_out"):
        parts.append("allow " + ", ".join(policy["allow_out"]))
    if policy.get("deny_out"):
        parts.append("deny " + ", ".join(policy["deny_out"]))
    for key in ("egress", "resolver"):
        ref = policy.get(key)
        if isinstance(ref, dict):
            parts.append(f"{key} {ref.get('name')} (revision {ref.get('revision')})")
        elif ref:
            parts.append(f"{key} {ref}")
    return "; ".join(parts)


def _add_list_and_get(group: click.Group, path: str, key: str, columns: Sequence[str],
                      row: Callable[[dict[str, Any]], Row], check_name: Callable[[str], str],
                      sections: Callable[[dict[str, Any]], list[Section]], *,
                      list_help: str, get_help: str) -> None:
    """``list`` and ``get NAME`` of a kind of record known by its name (Egresses,
    Resolvers) on `group`: the table of everything under `path`, and one record's
    sections; the name is checked before anything is sent."""

    @group.command("list", help=list_help)
    @kibo_options
    def list_command(inv: Invocation) -> None:
        inv.list_table(path, key, columns, row)

    @group.command("get", help=get_help)
    @click.argument("name")
    @kibo_options
    def get_command(inv: Invocation, name: str) -> None:
        found = inv.client().get(resource_path(path, check_name(name)))
        inv.out.result(found, lambda: inv.out.sections(sections(found)))


# ------------------------------------------------------------------ egress


@click.group("egress")
def egress_group() -> None:
    """Egresses: SOCKS5 endpoints a Workspace's TCP goes through."""


def _egress_path(name: str, action: str = "") -> str:
    return resource_path("/v1/egresses", name, action)


def _egress_text(egress: dict[str, Any]) -> str:
    auth = (f"authenticated as {egress.get('username')}" if egress.get("authenticated")
            else "no credentials")
    return f"revision {egress.get('revision')} ({egress.get('address')}, {auth})"


def egress_row(egress: dict[str, Any]) -> Row:
    return [str(egress.get("name")), dash(egress.get("address")),
            yes_no(egress.get("authenticated")), dash(egress.get("username")),
            dash(egress.get("revision")), dash(egress.get("updated_at"))]


def egress_sections(egress: dict[str, Any]) -> list[Section]:
    section = Section(f"Egress {egress.get('name')}")
    section.add("Address", dash(egress.get("address")))
    section.add("Authenticated", yes_no(egress.get("authenticated")))
    section.add_fields(egress, {"Username": "username", "Revision": "revision",
                                "Created": "created_at", "Updated": "updated_at"})
    return [section]


@egress_group.command("create")
@click.argument("name")
@click.option("--address", required=True, metavar="HOST:PORT",
              help="Where the SOCKS5 server listens.")
@click.option("--username", metavar="USER", help="SOCKS5 username (with --password-file).")
@click.option("--password-file", metavar="FILE",
              help="File holding the SOCKS5 password ('-': stdin); ctrl stores it sealed "
                   "and never shows it.")
@command_id_option
@kibo_options
def egress_create(inv: Invocation, name: str, address: str, username: str | None,
                  password_file: str | None, command_id: str | None) -> None:
    """Create an Egress."""
    body = {"name": egress_name(name), "address": socks_address(address),
            "command_id": check_command_id(command_id),
            **_credentials(username, password_file)}
    if "password" in body:
        refuse_clear_text(inv)
    egress = inv.client().post("/v1/egresses", body)
    inv.out.result(egress, lambda: inv.out.line(f"egress {name}: created, {_egress_text(egress)}"))


_add_list_and_get(egress_group, "/v1/egresses", "egresses", EGRESS_COLUMNS, egress_row,
                  egress_name, egress_sections, list_help="List Egresses.",
                  get_help="Show one Egress (never its password).")


@egress_group.command("update")
@click.argument("name")
@click.option("--address", metavar="HOST:PORT", help="A new address.")
@click.option("--username", metavar="USER", help="New credentials (with --password-file).")
@click.option("--password-file", metavar="FILE", help="File holding the new password.")
@click.option("--no-credentials", is_flag=True, help="Remove the username and password.")
@versioned_write_options
def egress_update(inv: Invocation, name: str, address: str | None, username: str | None,
                  password_file: str | None, no_credentials: bool, command_id: str | None,
                  expected_version: int | None) -> None:
    """Change an Egress (a new revision); what is not given is kept.  ctrl switches
    the running Workspaces that use it to the new revision, without a restart."""
    egress_name(name)
    if no_credentials and (username is not None or password_file is not None):
        raise click.UsageError("--no-credentials excludes --username and --password-file")
    if address is None and username is None and password_file is None and not no_credentials:
        raise click.UsageError("give --address, --username with --password-file, or "
                               "--no-credentials")
    body: dict[str, Any] = {
        "address": None if address is None else socks_address(address),
        "clear_credentials": no_credentials or None,
        "command_id": check_command_id(command_id), "expected_version": expected_version,
        **_credentials(username, password_file)}
    if "password" in body:
        refuse_clear_text(inv)
    out = inv.client().post(_egress_path(name, "update"), body)
    inv.out.result(out, lambda: inv.out.line(
        f"egress {name}: {out.get('outcome')}, {_egress_text(out.get('egress') or {})}"))


@egress_group.command("delete")
@click.argument("name")
@versioned_write_options
def egress_delete(inv: Invocation, name: str, command_id: str | None,
                  expected_version: int | None) -> None:
    """Delete an Egress no Workspace (that is not DELETED) or Resolver uses."""
    out = inv.client().delete(_egress_path(egress_name(name)), {
        "command_id": check_command_id(command_id), "expected_version": expected_version})
    inv.out.result(out, lambda: inv.out.line(
        f"egress {name} deleted (it was at revision {out.get('revision')})"))


# ------------------------------------------------------------------ resolver


@click.group("resolver")
def resolver_group() -> None:
    """Resolvers: DNS upstreams for Workspaces, direct or through an Egress."""


def _resolver_path(name: str) -> str:
    return resource_path("/v1/resolvers", name)


def resolver_row(resolver: dict[str, Any]) -> Row:
    return [str(resolver.get("name")), dash(resolver.get("upstream")),
            dash(resolver.get("via_egress")), dash(resolver.get("revision")),
            dash(resolver.get("updated_at"))]


@resolver_group.command("create")
@click.argument("name")
@click.option("--upstream", required=True, metavar="ADDR[:PORT]",
              help="The DNS server (address or host name; port 53 by default).")
@click.option("--via-egress", metavar="EGRESS",
              help="Reach the upstream through this Egress (Workspaces using the Resolver "
                   "must name it with --egress too).")
@command_id_option
@kibo_options
def resolver_create(inv: Invocation, name: str, upstream: str, via_egress: str | None,
                    command_id: str | None) -> None:
    """Create a Resolver."""
    body = {"name": resolver_name(name), "upstream": upstream_endpoint(upstream),
            "via_egress": None if via_egress is None else egress_name(via_egress,
                                                                      "--via-egress"),
            "command_id": check_command_id(command_id)}
    out = inv.client().post("/v1/resolvers", body)
    via = f" via egress {out.get('via_egress')}" if out.get("via_egress") else ""
    inv.out.result(out, lambda: inv.out.line(
        f"resolver {name}: created, revision {out.get('revision')} ({out.get('upstream')}{via})"))


def resolver_sections(resolver: dict[str, Any]) -> list[Section]:
    section = Section(f"Resolver {resolver.get('name')}")
    section.add_fields(resolver, {"Upstream": "upstream", "Via egress": "via_egress",
                                  "Revision": "revision", "Created": "created_at",
                                  "Updated": "updated_at"})
    return [section]


_add_list_and_get(resolver_group, "/v1/resolvers", "resolvers", RESOLVER_COLUMNS,
                  resolver_row, resolver_name, resolver_sections,
                  list_help="List Resolvers.", get_help="Show one Resolver.")


@resolver_group.command("delete")
@click.argument("name")
@versioned_write_options
def resolver_delete(inv: Invocation, name: str, command_id: str | None,
                    expected_version: int | None) -> None:
    """Delete a Resolver no Workspace (that is not DELETED) uses."""
    out = inv.client().delete(_resolver_path(resolver_name(name)), {
        "command_id": check_command_id(command_id), "expected_version": expected_version})
    if inv.as_json:
        inv.out.json_result(out)
    else:
        inv.out.line(f"resolver {name} deleted")
