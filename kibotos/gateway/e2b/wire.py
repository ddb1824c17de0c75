"""E2B's control-API request bodies as the gateway accepts them (pydantic, strict), and
its error body.

Unknown fields are refused, naming them, and so is every option kibotos cannot honour
(`unsupported`): a caller learns at once that a feature is missing instead of getting a
sandbox without it.  Field names are E2B's (camelCase, and ``allow_internet_access``
as E2B spells it).
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)
from starlette.responses import JSONResponse

from kibotos.core.errors import InvalidArgument, KibotosError

_CONFIG = ConfigDict(extra="forbid", frozen=True, strict=True)
#: How long E2B lets one call ask for (seconds); kibotos adds its own cap from config.
MAX_TIMEOUT = 366 * 86400

#: kibotos error codes as E2B's HTTP statuses (the SDK picks its exception by them).
#: ``resource_exhausted`` (no node can take the Workspace) is 503, "busy, retry": E2B's
#: 429 would make the SDK say "rate limit", which the gateway has none of.
STATUS = {"invalid_argument": 400, "unauthenticated": 401, "permission_denied": 403,
          "not_found": 404, "already_exists": 409, "aborted": 409,
          "failed_precondition": 409, "resource_exhausted": 503, "internal": 500,
          "unavailable": 503, "deadline_exceeded": 504}


#: At most this many ``dnsServers`` (E2B's limit).
MAX_DNS_SERVERS = 10


def _ipv4_addresses(servers: list[str]) -> list[str]:
    for server in servers:
        try:
            if not server.isascii():
                raise ValueError
            ipaddress.IPv4Address(server)
        except ValueError:
            raise ValueError(f"{server!r} is not an IPv4 address") from None
    return servers


#: E2B's ``dnsServers``: the DNS servers a sandbox may reach when ``allowOut`` names a
#: domain.  kibotos takes CIDRs only in ``allowOut`` (domains are refused), so the
#: list is checked and shown, and never widens a policy (docs/gateways.md).
DnsServers = Annotated[list[StrictStr], Field(max_length=MAX_DNS_SERVERS),
                       AfterValidator(_ipv4_addresses)]


class AutoResume(BaseModel):
    model_config = _CONFIG
    enabled: StrictBool = False


class EgressProxy(BaseModel):
    """A SOCKS5 server the sandbox's TCP goes through: a kibotos Egress of its own."""

    model_config = _CONFIG
    address: StrictStr
    username: StrictStr | None = None
    password: StrictStr | None = None
    tls: Any = None


class Network(BaseModel):
    model_config = _CONFIG
    allowOut: list[StrictStr] | None = None
    denyOut: list[StrictStr] | None = None
    allowPublicTraffic: StrictBool | None = None
    dnsServers: DnsServers | None = None
    maskRequestHost: StrictStr | None = None
    egressProxy: EgressProxy | None = None
    rules: Any = None
    httpsPorts: Any = None


class NewSandbox(BaseModel):
    model_config = _CONFIG
    templateID: StrictStr = Field(min_length=1, max_length=128)
    timeout: StrictInt | None = Field(default=None, ge=1, le=MAX_TIMEOUT)
    autoPause: StrictBool = False
    autoPauseMemory: StrictBool | None = None
    autoResume: AutoResume | None = None
    secure: StrictBool = True
    allow_internet_access: StrictBool | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    envVars: dict[StrictStr, StrictStr] | None = None
    network: Network | None = None
    mcp: Any = None
    volumeMounts: list[Any] | None = None

    def unsupported(self) -> list[str]:
        """The options asked for that kibotos cannot do."""
        out = []
        if self.autoPauseMemory:
            out.append("autoPauseMemory (memory snapshots)")
        if self.mcp is not None:
            out.append("mcp")
        if self.volumeMounts:
            out.append("volumeMounts")
        net = self.network
        if net is not None:
            out += [f"network.{name}" for name in ("maskRequestHost", "rules", "httpsPorts")
                    if getattr(net, name) is not None]
            if net.egressProxy is not None and net.egressProxy.tls:
                out.append("network.egressProxy.tls (TLS to the SOCKS5 server)")
        return out

    def auto_resumes(self) -> bool:
        """Whether traffic should wake the sandbox when paused; `InvalidArgument` for
        the combinations E2B refuses too.  A kibotos pause keeps the filesystem
        only, so a wake is a cold boot from the kept layer (docs/gateways.md,
        "autoResume"): the request that woke it waits for the boot, and processes of
        before the pause are gone.  ``autoPauseMemory: false`` asks for exactly that
        pause, but E2B refuses it with ``autoResume`` (its wakes restore memory in
        place), so the gateway does too: a client written against E2B sees the same
        answer here as there."""
        if self.autoResume is None or not self.autoResume.enabled:
            return False
        if not self.autoPause:
            raise InvalidArgument("autoResume needs autoPause: only a sandbox paused at "
                                  "its timeout (on_timeout \"pause\") can be resumed")
        if self.autoPauseMemory is False:
            raise InvalidArgument("autoResume cannot be combined with autoPauseMemory "
                                  "false (a filesystem-only pause): resume such a "
                                  "sandbox with connect()")
        return True

    def public_traffic(self) -> bool:
        """Whether anyone may reach the sandbox's ports through the Exposure gateway
        (E2B's default), or only a client with its traffic access token."""
        return self.network is None or self.network.allowPublicTraffic is not False


class NetworkUpdate(BaseModel):
    """``PUT /sandboxes/{id}/network``: the whole egress configuration, replaced (what
    is left out is cleared, as E2B does)."""

    model_config = _CONFIG
    allowOut: list[StrictStr] | None = None
    denyOut: list[StrictStr] | None = None
    dnsServers: DnsServers | None = None
    egressProxy: EgressProxy | None = None
    rules: Any = None
    allow_internet_access: StrictBool | None = None

    def unsupported(self) -> list[str]:
        out = ["network.rules"] if self.rules is not None else []
        if self.egressProxy is not None and self.egressProxy.tls:
            out.append("network.egressProxy.tls (TLS to the SOCKS5 server)")
        return out


def network_info(allow_out: list[str] | None, deny_out: list[str] | None,
                 dns_servers: list[str] | None, public_traffic: bool | None,
                 proxy: EgressProxy | None) -> dict[str, Any]:
    """E2B's ``network`` of a sandbox detail, as asked: what a get shows.  An egress
    proxy is its address and username; its password is never shown (ctrl seals it)."""
    out: dict[str, Any] = {}
    for key, value in (("allowOut", allow_out), ("denyOut", deny_out),
                       ("dnsServers", dns_servers), ("allowPublicTraffic", public_traffic)):
        if value is not None:
            out[key] = list(value) if isinstance(value, list) else value
    if proxy is not None:
        out["egressProxy"] = {"address": proxy.address}
        if proxy.username is not None:
            out["egressProxy"]["username"] = proxy.username
    return out


class TimeoutBody(BaseModel):
    model_config = _CONFIG
    timeout: StrictInt = Field(ge=1, le=MAX_TIMEOUT)


class ConnectBody(BaseModel):
    model_config = _CONFIG
    timeout: StrictInt = Field(default=300, ge=1, le=MAX_TIMEOUT)
    memory: StrictBool | None = None


class PauseBody(BaseModel):
    model_config = _CONFIG
    memory: StrictBool | None = None


def error_response(exc: KibotosError) -> JSONResponse:
    """E2B's error body, ``{"code": <HTTP status>, "message"}``."""
    status = STATUS.get(exc.code, 500)
    return JSONResponse({"code": status, "message": exc.message}, status_code=status)


def describe(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
                     for e in exc.errors())
