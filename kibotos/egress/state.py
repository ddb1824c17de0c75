"""The routing state the node hands to its egress process (the ``state`` request),
checked strictly: which Instance's guest goes through which Egress revision and to which
Resolver, the credentials of those revisions, and the node's resolver list.

The state is replaced whole on every request, as the data plane's is.  Credentials
live only here, in memory: they are never logged (``repr`` leaves them out), and a
draining generation drops them (`EgressState.without_credentials`), so after a build
change only the newest process holds any.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from kibotos.core.errors import InvalidArgument
from kibotos.egress.endpoints import Endpoint, parse_endpoint
from kibotos.egress.sockets import check_role

#: RFC 1929: a username and a password are 1-255 bytes each (and never in a ``repr``).
Secret = Annotated[StrictStr, Field(min_length=1, max_length=255)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")


class EgressRoute(_Strict):
    """A caller's SOCKS5 server, by Egress name and revision."""

    name: StrictStr
    revision: StrictInt
    address: StrictStr
    username: Secret | None = Field(default=None, repr=False)
    password: Secret | None = Field(default=None, repr=False)

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        _endpoint(v, "egress address", None)
        return v

    @model_validator(mode="after")
    def _pair(self) -> EgressRoute:
        if (self.username is None) != (self.password is None):
            raise ValueError("username and password come together or not at all")
        for value in (self.username, self.password):
            if value is not None and len(value.encode()) > 255:
                raise ValueError("a username or password is longer than 255 bytes")
        return self

    @property
    def endpoint(self) -> Endpoint:
        return parse_endpoint(self.address, "egress address")

    @property
    def authenticated(self) -> bool:
        return self.username is not None


class ResolverRoute(_Strict):
    """A caller's DNS upstream; port 53 unless the upstream names one."""

    name: StrictStr
    revision: StrictInt
    upstream: StrictStr
    via_egress: StrictBool = False

    @field_validator("upstream")
    @classmethod
    def _upstream(cls, v: str) -> str:
        _endpoint(v, "resolver upstream", 53)
        return v

    @property
    def endpoint(self) -> Endpoint:
        return parse_endpoint(self.upstream, "resolver upstream", default_port=53)


class InstanceRoute(_Strict):
    """One Instance: its guest's addresses (the only sources accepted on its sockets),
    its Egress and Resolver, and the socket roles it should have."""

    instance_id: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    guest: list[StrictStr] = Field(min_length=1, max_length=2)
    egress: EgressRoute | None = None
    resolver: ResolverRoute | None = None
    roles: list[StrictStr] = Field(default_factory=list)

    @field_validator("guest")
    @classmethod
    def _guest(cls, v: list[str]) -> list[str]:
        return [str(ipaddress.ip_address(a)) for a in v]

    @field_validator("roles")
    @classmethod
    def _roles(cls, v: list[str]) -> list[str]:
        for role in v:
            try:
                check_role(role)
            except InvalidArgument as exc:
                raise ValueError(exc.message) from None
        return v

    @model_validator(mode="after")
    def _via(self) -> InstanceRoute:
        if self.resolver is not None and self.resolver.via_egress and self.egress is None:
            raise ValueError("a resolver via the egress needs the Instance's egress")
        return self


class EgressState(_Strict):
    generation: StrictInt
    #: The node's ``[network] resolvers``: how upstream host names are resolved.
    resolvers: list[StrictStr] = Field(default_factory=list, max_length=16)
    instances: list[InstanceRoute] = Field(default_factory=list)

    @field_validator("resolvers")
    @classmethod
    def _resolvers(cls, v: list[str]) -> list[str]:
        return [str(ipaddress.ip_address(a)) for a in v]

    def by_instance(self) -> dict[str, InstanceRoute]:
        return {i.instance_id: i for i in self.instances}

    def without_credentials(self) -> EgressState:
        """The same routes with every username and password dropped (a draining
        generation's state)."""
        stripped = [i.model_copy(update={"egress": None if i.egress is None else
                                         i.egress.model_copy(update={"username": None,
                                                                     "password": None})})
                    for i in self.instances]
        return self.model_copy(update={"instances": stripped})


def _endpoint(value: str, what: str, default_port: int | None) -> None:
    try:
        parse_endpoint(value, what, default_port=default_port)
    except InvalidArgument as exc:
        raise ValueError(exc.message) from None


def parse_state(value: Any) -> EgressState:
    """The ``state`` request's body (without its ``type``); InvalidArgument naming the
    bad field, with no secret in the message."""
    if not isinstance(value, dict):
        raise InvalidArgument("egress state must be an object")
    try:
        return EgressState.model_validate({k: v for k, v in value.items() if k != "type"})
    except ValidationError as exc:
        parts = []
        for err in exc.errors(include_input=False):
            loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
            parts.append(f"{loc}: {err['msg'].removeprefix('Value error, ')}")
        raise InvalidArgument(f"invalid egress state: {'; '.join(parts)}") from None
