"""``kibo enroll`` (get in once) and ``kibo enrollment`` (let others in, or shut them out).

`kibo enroll` turns a one-time grant into this operator's identity: it makes an
Ed25519 key, exchanges the grant with its public half, and writes ``kibo.toml``
(``ctrl_url``, the bearer ``credential``, the pinned ``ctrl_ca`` of ``--ca-file`` and
the ``cluster_ca`` the exchange handed out; mode 0600) and the private key beside it
(``<name>.key``, PEM, 0600), both atomically.  A grant is exchanged once, so an
existing file is refused *before* the exchange unless ``--force`` is given: the grant
is not spent on a write that would be refused.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kibotos.cli.core import kibo_config
from kibotos.cli.core.client import Client
from kibotos.cli.core.options import Invocation, check_command_id, command_id_option, kibo_options
from kibotos.cli.core.output import dash
from kibotos.core import atomicfile, ids
from kibotos.core.errors import FailedPrecondition, InvalidArgument
from kibotos.core.units import parse_duration
from kibotos.tls.contexts import check_ca_pem, client_context, read_ca_file, require_secure

if TYPE_CHECKING:  # cryptography is imported by `kibo enroll` alone: the others stay fast
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

EXCHANGE_PATH = "/v1/enrollment/exchange"


def key_path(config_path: Path) -> Path:
    """Where `kibo enroll` keeps the private key: beside the config it wrote."""
    return config_path.with_suffix(".key")


def public_key_b64(key: Ed25519PrivateKey) -> str:
    """The raw 32-byte public key in standard base64, as ctrl stores it."""
    from cryptography.hazmat.primitives import serialization

    raw = key.public_key().public_bytes(serialization.Encoding.Raw,
                                        serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def _check_ctrl_url(url: str) -> str:
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise InvalidArgument(f"invalid --ctrl-url {url!r}: expected http://HOST:PORT or "
                              "https://HOST:PORT")
    return url.rstrip("/")


def _toml_string(value: str) -> str:
    # A JSON string is a valid TOML basic string for the characters JSON escapes.
    return json.dumps(value, ensure_ascii=False)


def render_config(ctrl_url: str, credential: str, *, ctrl_ca: bytes | None = None,
                  cluster_ca: str | None = None) -> bytes:
    lines = ["# written by `kibo enroll`; the credential is a secret",
             f"ctrl_url = {_toml_string(ctrl_url)}",
             f"credential = {_toml_string(credential)}"]
    if ctrl_ca is not None:
        lines.append(f"ctrl_ca = {_toml_string(ctrl_ca.decode())}")
    if cluster_ca is not None:
        lines.append(f"cluster_ca = {_toml_string(cluster_ca)}")
    return ("\n".join(lines) + "\n").encode()


def _cluster_ca(result: dict[str, Any]) -> str | None:
    """The cluster CA the exchange handed out (None from a ctrl without one)."""
    pem = result.get("cluster_ca")
    if pem is None:
        return None
    if not isinstance(pem, str):
        raise FailedPrecondition("ctrl's exchange answer has a cluster_ca that is not text")
    try:
        check_ca_pem(pem, "the cluster_ca of ctrl's exchange answer")
    except InvalidArgument as exc:
        raise FailedPrecondition(exc.message) from None
    return pem


@click.command("enroll")
@click.option("--ctrl-url", required=True, metavar="URL", help="ctrl's address.")
@click.option("--grant", "token", required=True, metavar="TOKEN",
              help="The one-time grant from `kibo enrollment create --kind operator` or "
                   "`kibotos ctrl grant --kind operator`.")
@click.option("--ca-file", metavar="FILE",
              help="The CA certificate (PEM) ctrl's certificate is verified against, "
                   "pinned in kibo.toml: ctrl's <state_dir>/cluster-ca.crt, or the CA of "
                   "the operator's certificate.  Default: the system trust store.")
@click.option("--force", is_flag=True, help="Replace an existing config file.")
@kibo_options
def enroll_command(inv: Invocation, ctrl_url: str, token: str, ca_file: str | None,
                   force: bool) -> None:
    """Exchange an operator grant for an identity and write kibo.toml."""
    url = _check_ctrl_url(ctrl_url)
    require_secure(url, "--ctrl-url")
    ctrl_ca = None if ca_file is None else read_ca_file(ca_file, "--ca-file")
    token = token.strip()
    if not token or any(c.isspace() for c in token):
        raise InvalidArgument("invalid --grant: expected a token such as kgr-….…")
    path = inv.config_path
    if path.exists() and not force:
        raise FailedPrecondition(f"{path} already exists: add --force to replace it "
                                 "(the grant was not used)")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    with Client(url, None, deadline=inv.deadline, verify=client_context(ctrl_ca)) as client:
        result = client.post(EXCHANGE_PATH, {"token": token, "public_key": public_key_b64(key)},
                             write=False)
    if result.get("kind") != "operator":
        raise FailedPrecondition(
            f"the grant was for a {result.get('kind')} identity (node "
            f"{result.get('node_id')}), not an operator; it is now used up, so revoke "
            f"{result.get('identity_id')} with `kibo enrollment revoke` and create an "
            "operator grant")
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    atomicfile.write_bytes(key_path(path), pem, mode=0o600)
    config = render_config(url, str(result["credential"]), ctrl_ca=ctrl_ca,
                           cluster_ca=_cluster_ca(result))
    atomicfile.write_bytes(path, config, mode=0o600)
    summary = {"identity_id": result.get("identity_id"), "kind": result.get("kind"),
               "node_id": result.get("node_id"), "config": str(path)}
    if inv.as_json:
        inv.out.json_result(summary)  # never the credential: it stays in the file
    else:
        inv.out.line(f"enrolled as {result.get('identity_id')}; wrote {path}")
        if kibo_config.kibo_config_path(None) != path:
            inv.out.message(f"use it with --config {path} or export KIBO_CONFIG={path}")


@click.group("enrollment")
def enrollment_group() -> None:
    """Issue, list and revoke enrollment grants and identities."""


@enrollment_group.command("create")
@click.option("--kind", type=click.Choice(["node", "operator"]), required=True)
@click.option("--node-id", metavar="NODE", help="The node the grant is for (kind node).")
@click.option("--name", metavar="TEXT", help="A note saying who or what it is for.")
@click.option("--expires", metavar="DURATION", default="1h", show_default=True,
              help="How long the grant can be exchanged, e.g. 30m, 24h.")
@command_id_option
@kibo_options
def create_grant(inv: Invocation, kind: str, node_id: str | None, name: str | None,
                 expires: str, command_id: str | None) -> None:
    """Issue a one-time grant; prints its token (a secret)."""
    if kind == "node" and node_id is None:
        raise click.UsageError("--kind node needs --node-id")
    if kind == "operator" and node_id is not None:
        raise click.UsageError("--node-id is only for --kind node")
    if node_id is not None:
        ids.check_node_id(node_id)
    seconds = parse_duration(expires, "--expires")
    if seconds <= 0:
        raise InvalidArgument(f"--expires must be positive, got {expires!r}")
    result = inv.client().post("/v1/enrollment/grants", {
        "kind": kind, "node_id": node_id, "name": name, "expires_in_s": seconds,
        "command_id": check_command_id(command_id),
    })
    if inv.as_json:
        inv.out.json_result(result)
        return
    inv.out.line(str(result.get("token")))
    target = f"node {result.get('node_id')}" if result.get("kind") == "node" else "an operator"
    inv.out.message(f"grant {result.get('grant_id')} for {target}, usable once until "
                    f"{dash(result.get('expires_at'))}")


def _grant_row(g: dict[str, Any]) -> list[str]:
    return [dash(g.get("grant_id")), dash(g.get("kind")), dash(g.get("node_id")),
            dash(g.get("name")), dash(g.get("state")), dash(g.get("expires_at")),
            dash(g.get("identity_id"))]


def _identity_row(i: dict[str, Any]) -> list[str]:
    return [dash(i.get("identity_id")), dash(i.get("kind")), dash(i.get("node_id")),
            dash(i.get("name")), dash(i.get("state")), dash(i.get("created_at")),
            dash(i.get("grant_id"))]


def _grant_tables(inv: Invocation, result: dict[str, Any]) -> None:
    inv.out.table(("GRANT", "KIND", "NODE", "NAME", "STATE", "EXPIRES", "IDENTITY"),
                  [_grant_row(g) for g in result.get("grants") or []], title="Grants")
    inv.out.table(("IDENTITY", "KIND", "NODE", "NAME", "STATE", "CREATED", "GRANT"),
                  [_identity_row(i) for i in result.get("identities") or []],
                  title="Identities")


@enrollment_group.command("list")
@kibo_options
def list_grants(inv: Invocation) -> None:
    """List grants and the identities made from them."""
    result = inv.client().get("/v1/enrollment/grants")
    inv.out.result(result, lambda: _grant_tables(inv, result))


@enrollment_group.command("revoke")
@click.argument("target_id", metavar="ID")
@command_id_option
@kibo_options
def revoke(inv: Invocation, target_id: str, command_id: str | None) -> None:
    """Revoke a grant or an identity; a revoked identity is refused at once."""
    ids.check_object_id(target_id, "grant or identity ID")
    if not target_id.startswith(("kgr-", "kid-")):
        raise InvalidArgument(f"invalid grant or identity ID {target_id!r}: must be a grant "
                              "(kgr-…) or an identity (kid-…)")
    result = inv.client().post("/v1/enrollment/revoke", {
        "id": target_id, "command_id": check_command_id(command_id)})
    if inv.as_json:
        inv.out.json_result(result)
    else:
        revoked = result.get("revoked") or []
        inv.out.line(f"revoked {', '.join(revoked)}" if revoked else "nothing to revoke")
