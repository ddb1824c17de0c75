"""Request and result shapes of Workspace network policies, Egresses and Resolvers
(docs/network.md, "The policy in ctrl").

Every model here is strict (``"true"`` is not a boolean, ``1`` is not a string) and
refuses unknown fields, and every value with a shape is checked before the command
journal sees the request: CIDRs by `kibotos.core.cidrs` (the protocol's `Cidr`, kept in
canonical text), names by the Template name rule, endpoints by `kibotos.endpoints`.
A password is a `SecretStr`: it never shows in a model's text, its dump or a
validation error, and no result model has a field for it except the credentials a
node fetches.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    SecretStr,
    StrictBool,
    StrictStr,
    model_validator,
)

from kibotos import endpoints
from kibotos.core import ids
from kibotos.ctrl.wire.base import Query, Request, Result, VersionedWrite, WriteRequest
from kibotos.protocol.commands.network import MAX_CIDRS, Cidr
from kibotos.protocol.ids import RESOURCE_NAME_PATTERN, as_validator

#: RFC 1929: a SOCKS5 username and password are 1-255 bytes each.
MAX_CREDENTIAL_BYTES = 255
DNS_PORT = 53
STRICT = ConfigDict(extra="forbid", frozen=True, strict=True)


def _name(kind: str) -> AfterValidator:
    return as_validator(lambda value: ids.check_resource_name(value, kind))


EgressName = Annotated[StrictStr, _name("egress name"), RESOURCE_NAME_PATTERN]
ResolverName = Annotated[StrictStr, _name("resolver name"), RESOURCE_NAME_PATTERN]


def _socks_address(value: str) -> str:
    return endpoints.canonical(value, "")


def _upstream(value: str) -> str:
    return endpoints.canonical(value, "", default_port=DNS_PORT)


#: ``host:port`` of a SOCKS5 server (port required), canonical.
SocksAddress = Annotated[StrictStr, Field(max_length=255), AfterValidator(_socks_address)]
#: ``addr[:port]`` of a DNS server (port 53 when absent), canonical with its port.
Upstream = Annotated[StrictStr, Field(max_length=255), AfterValidator(_upstream)]


def _username(value: str) -> str:
    size = len(value.encode())
    if not 1 <= size <= MAX_CREDENTIAL_BYTES:
        raise ValueError(f"must be 1-{MAX_CREDENTIAL_BYTES} bytes (UTF-8)")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError("must not contain control characters")
    return value


def _password(value: SecretStr) -> SecretStr:
    # The message never quotes the value: validation errors reach logs and callers.
    if not 1 <= len(value.get_secret_value().encode()) <= MAX_CREDENTIAL_BYTES:
        raise ValueError(f"must be 1-{MAX_CREDENTIAL_BYTES} bytes (UTF-8)")
    return value


Username = Annotated[StrictStr, AfterValidator(_username)]
Password = Annotated[SecretStr, AfterValidator(_password)]


# ----------------------------------------------------------------------- requests


class NetworkIn(Request):
    """A Workspace's network policy as the operator writes it (E2B's model): with no
    `allow_out` everything not denied is allowed, an address in both lists is allowed;
    `egress` and `resolver` by name."""

    model_config = STRICT

    public_egress: StrictBool = True
    allow_out: Annotated[list[Cidr], Field(max_length=MAX_CIDRS)] = Field(default_factory=list)
    deny_out: Annotated[list[Cidr], Field(max_length=MAX_CIDRS)] = Field(default_factory=list)
    egress: EgressName | None = None
    resolver: ResolverName | None = None

    def stored(self) -> dict[str, Any]:
        """The policy as the Workspace keeps it (and the API shows it)."""
        return self.model_dump(mode="json")


class WorkspaceSetNetworkIn(VersionedWrite):
    """Replace a Workspace's whole network policy.  `network` absent or null: back to
    the deployment default.  `expected_version` is the Workspace's revision."""

    model_config = STRICT

    network: NetworkIn | None = None


def _credentials_together(username: str | None, password: SecretStr | None) -> None:
    if (username is None) != (password is None):
        raise ValueError("give username and password together (or neither)")


class EgressCreateIn(WriteRequest):
    model_config = STRICT

    name: EgressName
    address: SocksAddress
    username: Username | None = None
    password: Password | None = None

    @model_validator(mode="after")
    def _together(self) -> EgressCreateIn:
        _credentials_together(self.username, self.password)
        return self


class EgressUpdateIn(VersionedWrite):
    """What changes; the rest is kept.  Credentials change as a pair; `clear_credentials`
    removes them.  `expected_version` is the Egress's revision."""

    model_config = STRICT

    address: SocksAddress | None = None
    username: Username | None = None
    password: Password | None = None
    clear_credentials: StrictBool = False

    @model_validator(mode="after")
    def _coherent(self) -> EgressUpdateIn:
        _credentials_together(self.username, self.password)
        if self.clear_credentials and self.username is not None:
            raise ValueError("clear_credentials and username/password exclude each other")
        if self.address is None and self.username is None and not self.clear_credentials:
            raise ValueError("give address, username and password, or clear_credentials")
        return self


class ResolverCreateIn(WriteRequest):
    model_config = STRICT

    name: ResolverName
    upstream: Upstream
    via_egress: EgressName | None = None


class NamedDeleteIn(VersionedWrite):
    """Delete a named record; `expected_version` is its revision."""

    model_config = STRICT


class CredentialsQuery(Query):
    """Query strings are text: the revision is read as a number, bounded."""

    revision: int = Field(ge=1, le=(1 << 53) - 1)


# ------------------------------------------------------------------------ results


class NetworkPolicyOut(Result):
    public_egress: bool
    allow_out: list[str]
    deny_out: list[str]
    egress: str | None
    resolver: str | None


class WorkspaceNetworkOut(Result):
    #: Null: the deployment default (the network its node provides).
    policy: NetworkPolicyOut | None
    revision: int


class EgressRefOut(Result):
    name: str
    revision: int
    address: str
    authenticated: bool


class ResolverRefOut(Result):
    name: str
    revision: int
    upstream: str
    via_egress: bool


class AppliedNetworkOut(Result):
    """The policy in force on an Instance, as its node was sent it."""

    public_egress: bool
    allow_out: list[str]
    deny_out: list[str]
    egress: EgressRefOut | None = None
    resolver: ResolverRefOut | None = None


class EgressOut(Result):
    name: str
    address: str
    #: Whether it has a username and password; the password is never shown.
    authenticated: bool
    username: str | None
    revision: int
    created_at: str
    updated_at: str


class EgressListOut(Result):
    egresses: list[EgressOut]


class EgressUpdateOut(Result):
    egress: EgressOut
    outcome: Literal["updated", "unchanged"]


class EgressCredentialsOut(Result):
    """What a node running a Workspace that references this revision is handed."""

    name: str
    revision: int
    address: str
    username: str | None
    password: str | None


class ResolverOut(Result):
    name: str
    upstream: str
    via_egress: str | None
    revision: int
    created_at: str
    updated_at: str


class ResolverListOut(Result):
    resolvers: list[ResolverOut]
