"""Configuration files of every role: TOML, validated so a bad file names the bad key.

Unknown keys are errors (a typo must not silently become a default).  Loading never
writes anything.  The operator CLI's ``kibo.toml`` is not here: it is
`kibotos.cli.core.kibo_config`, without pydantic, so that ``kibo`` starts fast.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kibotos.core import units
from kibotos.core.errors import InvalidArgument
from kibotos.core.toml_file import read_toml
from kibotos.network_config import NetworkSection
from kibotos.protocol.ids import NodeId, PoolId
from kibotos.tls.contexts import (
    client_context_from_file,
    is_loopback,
    require_secure,
)

M = TypeVar("M", bound=BaseModel)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_listen(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) \
            or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected host:port, got {value!r}")
    return value


class PluginsSection(_Strict):
    disable: list[str] = Field(default_factory=list)


# ---------------------------------------------------------------------------- ctrl


class CtrlSection(_Strict):
    listen: str = "127.0.0.1:7400"
    state_dir: Path = Path("/var/lib/kibotos/ctrl")
    database_url: str = ""
    reconcile_interval: float = 60.0
    session_timeout: float = 15.0
    overcommit_ack_timeout: float = 5.0
    placement_policy: str = "binpack"
    artifact_dir: Path | None = None

    _listen = field_validator("listen")(lambda v: _check_listen(v))

    @field_validator("reconcile_interval", "session_timeout", "overcommit_ack_timeout",
                     mode="before")
    @classmethod
    def _duration(cls, v: Any) -> float:
        return units.parse_duration(v)


class CtrlTestingSection(_Strict):
    """Test and dev-cluster inputs of ctrl; see docs/dev.md.  Never set in production."""

    #: The capacity a pool whose capacity was never set gets at its first Workspace
    #: create, as if the operator had run ``kibo storage-pool set-capacity`` (so test
    #: and dev clusters can create without that step).  None: the spec's behaviour.
    pool_capacity: int | None = None

    @field_validator("pool_capacity", mode="before")
    @classmethod
    def _size(cls, v: Any) -> int | None:
        return None if v is None or v == "" else units.parse_size(v, "pool_capacity")


class CtrlMetricsSection(_Strict):
    """``GET /metrics`` on ctrl's API address (docs/metrics.md)."""

    enabled: bool = True
    #: Ask for an operator credential (``Authorization: Bearer``), as the API does.
    require_auth: bool = False
    #: The gauges counted in the store (Workspaces, Instances, pools, the command
    #: journal) are at most this old: several scrapes in a row share one read.
    refresh_interval: float = 10.0

    @field_validator("refresh_interval", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> float:
        try:  # a ValueError, so the message names the key
            return units.parse_duration(v)
        except InvalidArgument as exc:
            raise ValueError(exc.message) from None


class CtrlTlsSection(_Strict):
    """How ctrl's API is served (docs/enrollment.md, "TLS")."""

    #: False: plain HTTP, which carries bearer credentials in clear text, so it is
    #: refused unless ``ctrl.listen`` is a loopback address.
    enabled: bool = Field(default=True, strict=True)  # "no" is not False
    #: The operator's certificate (PEM, leaf first) and key; both or neither.  Neither:
    #: ctrl issues its own from the cluster CA at every start and renews it.
    cert_file: Path | None = None
    key_file: Path | None = None
    #: Names and addresses the issued certificate carries, besides the listen host,
    #: this host's name, ``localhost``, 127.0.0.1 and ::1.
    server_names: list[str] = Field(default_factory=list)
    #: How long a node's data-plane certificate is valid; the node renews it once a
    #: third of it is left (tests shorten it).
    dataplane_cert_lifetime: float = 7 * 86400.0

    @field_validator("dataplane_cert_lifetime", mode="before")
    @classmethod
    def _lifetime(cls, v: Any) -> float:
        try:
            seconds = units.parse_duration(v)
        except InvalidArgument as exc:
            raise ValueError(exc.message) from None
        if not 60 <= seconds <= 90 * 86400:
            raise ValueError("must be between 1m and 90d")
        return seconds

    @model_validator(mode="after")
    def _pair(self) -> CtrlTlsSection:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together (or neither: the "
                             "certificate is issued from the cluster CA)")
        if not self.enabled and (self.cert_file is not None or self.server_names):
            raise ValueError("enabled = false serves plain HTTP: cert_file, key_file and "
                             "server_names have no use then")
        return self


class CtrlConfig(_Strict):
    ctrl: CtrlSection = Field(default_factory=CtrlSection)
    tls: CtrlTlsSection = Field(default_factory=CtrlTlsSection)
    metrics: CtrlMetricsSection = Field(default_factory=CtrlMetricsSection)
    plugins: PluginsSection = Field(default_factory=PluginsSection)
    testing: CtrlTestingSection = Field(default_factory=CtrlTestingSection)

    @model_validator(mode="after")
    def _plain_on_loopback_only(self) -> CtrlConfig:
        host = self.ctrl.listen.rpartition(":")[0]
        if not self.tls.enabled and not is_loopback(host):
            raise ValueError(f"tls.enabled = false (plain HTTP) is allowed only on a "
                             f"loopback address, and ctrl.listen is {self.ctrl.listen!r}: "
                             "bearer credentials would cross the network in clear text")
        return self

    @property
    def database_url(self) -> str:
        """``[ctrl] database_url``, else the SQLite file ``ctrl.db`` in the state dir."""
        return self.ctrl.database_url or f"sqlite:///{self.ctrl.state_dir / 'ctrl.db'}"


# ---------------------------------------------------------------------------- node


#: At most this many ctrl URLs in ``[node] ctrl_url``.
MAX_CTRL_URLS = 16


class NodeSection(_Strict):
    id: NodeId
    #: ctrl's URL, or every ctrl replica's (docs/replicas.md): the node's processes use
    #: the first that answers and move to the next when it stops answering.
    ctrl_url: str | list[str]
    enrollment_grant_file: Path | None = None
    dataplane_listen: str = "127.0.0.1:7500"
    #: The data plane serves TLS with a certificate the node obtains from ctrl's
    #: cluster CA and renews (docs/dataplane.md, "TLS").  False: plain HTTP, which
    #: carries session credentials in clear text, so only on a loopback listen address.
    dataplane_tls: bool = Field(default=True, strict=True)
    #: The node's socket directory: the data plane's control socket is
    #: ``<socket_dir>/dataplane/control.sock``, and the directory names the node's
    #: data-plane units (their scope), so several nodes on one host need their own.
    socket_dir: Path = Path("/run/kibotos/node")
    #: ``host:port`` of the node's Prometheus ``/metrics`` (docs/metrics.md); empty:
    #: no metrics listener.
    metrics_listen: str = ""
    #: The CA (PEM) ctrl's certificate is verified against: ctrl's
    #: ``<state_dir>/cluster-ca.crt``, or the CA of the operator's certificate.  None:
    #: the system trust store.  An ``http://`` ctrl_url is allowed on loopback only.
    ctrl_ca_file: Path | None = None

    @field_validator("ctrl_url")
    @classmethod
    def _secure(cls, v: str | list[str]) -> str | list[str]:
        urls = v if isinstance(v, list) else [v]
        if not urls or len(urls) > MAX_CTRL_URLS:
            raise ValueError(f"must be a URL or a list of 1 to {MAX_CTRL_URLS} URLs")
        if len({u.rstrip("/") for u in urls}) != len(urls):
            raise ValueError("lists a URL twice")
        try:
            for url in urls:
                require_secure(url, "ctrl_url")
        except InvalidArgument as exc:
            raise ValueError(exc.message) from None
        return v

    @property
    def ctrl_urls(self) -> tuple[str, ...]:
        """Every ctrl URL, in the order tried, without a trailing slash."""
        urls = self.ctrl_url if isinstance(self.ctrl_url, list) else [self.ctrl_url]
        return tuple(u.rstrip("/") for u in urls)

    @field_validator("socket_dir")
    @classmethod
    def _socket_dir(cls, v: Path) -> Path:
        if not v.is_absolute():
            raise ValueError(f"must be an absolute path, got {str(v)!r}")
        # sun_path holds 107 bytes; the longest sockets below it are dataplane/control.sock
        # and the data plane generations' dataplane/g<N>.sock (no longer, N < 1,000,000)
        if len(os.fsencode(v)) + len("/dataplane/control.sock") > 107:
            raise ValueError(f"{str(v)!r} is too long for the unix sockets under it "
                             "(at most 84 bytes)")
        return v

    @model_validator(mode="after")
    def _plain_on_loopback(self) -> NodeSection:
        host = self.dataplane_listen.rpartition(":")[0].strip("[]")
        if not self.dataplane_tls and not is_loopback(host):
            raise ValueError(f"dataplane_tls = false serves session credentials in clear "
                             f"text: allowed only on a loopback dataplane_listen, not "
                             f"{self.dataplane_listen!r}")
        return self

    def dataplane_address(self) -> str:
        """What the node reports to ctrl as its data-plane address: ``https://host:port``
        with TLS, the bare ``host:port`` for plain HTTP (`kibotos.protocol.messages.Hello`)."""
        return f"https://{self.dataplane_listen}" if self.dataplane_tls \
            else self.dataplane_listen

    def ctrl_tls(self) -> ssl.SSLContext:
        """The context every connection to ctrl verifies it with (read at each call:
        an unreadable CA file is an `InvalidArgument` naming it)."""
        return client_context_from_file(self.ctrl_ca_file, "node.ctrl_ca_file")

    _listen = field_validator("dataplane_listen")(lambda v: _check_listen(v))
    _metrics_listen = field_validator("metrics_listen")(
        lambda v: _check_listen(v) if v else v)


class PoolSection(_Strict):
    id: PoolId
    path: Path
    default: bool = False
    shared: bool = False
    driver: str = "local"
    capacity: Any = None  # removed key: refused with the spec's message below

    @field_validator("path")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        if not v.is_absolute():
            raise ValueError(f"pool path must be absolute, got {str(v)!r}")
        return v

    @model_validator(mode="after")
    def _no_capacity(self) -> PoolSection:
        if self.capacity is not None:
            raise ValueError(
                "storage.pool.capacity was removed: delete it and set the capacity on ctrl "
                "with `kibo storage-pool set-capacity`"
            )
        return self


class StorageSection(_Strict):
    root: Path
    template_cache_limit: int = 100 * 2**30
    #: Total size of ``machine-logs/`` (log tails of ended Instances); oldest go first.
    machine_logs_limit: int = 2**30
    pool: list[PoolSection] = Field(default_factory=list)

    @field_validator("template_cache_limit", mode="before")
    @classmethod
    def _size(cls, v: Any) -> int:
        return units.parse_size(v, "template_cache_limit")

    @field_validator("machine_logs_limit", mode="before")
    @classmethod
    def _logs_size(cls, v: Any) -> int:
        return units.parse_size(v, "machine_logs_limit")

    @model_validator(mode="after")
    def _defaults(self) -> StorageSection:
        seen: set[str] = set()
        for p in self.pool:
            if p.id in seen:
                raise ValueError(f"storage pool {p.id!r} is declared twice")
            seen.add(p.id)
        if len(self.pool) > 1 and sum(p.default for p in self.pool) != 1:
            raise ValueError("with several [[storage.pool]], exactly one must have default = true")
        return self

    def default_pool(self) -> PoolSection | None:
        if len(self.pool) == 1:
            return self.pool[0]
        return next((p for p in self.pool if p.default), None)


class ResourcesSection(_Strict):
    cpu_millis: int = Field(alias="cpu")
    memory_bytes: int = Field(alias="memory")

    @field_validator("cpu_millis", mode="before")
    @classmethod
    def _cpu(cls, v: Any) -> int:
        # TOML gives an int or a float; a string is read as `kibotos.core.units` reads
        # numbers (ASCII digits: float() would take "1_0", " 4 ", "nan" and "٣").
        if isinstance(v, bool) or not isinstance(v, int | float | str):
            raise ValueError(f"cpu must be a number of cores, got {v!r}")
        try:
            cores = float(units.parse_decimal(v, "cpu")) if isinstance(v, str) else float(v)
        except InvalidArgument:
            raise ValueError(f"cpu must be a number of cores, got {v!r}") from None
        if not cores < float("inf"):
            raise ValueError(f"cpu must be a number of cores, got {v!r}")
        millis = round(cores * 1000)
        if millis <= 0:
            raise ValueError("cpu must be positive")
        return millis

    @field_validator("memory_bytes", mode="before")
    @classmethod
    def _memory(cls, v: Any) -> int:
        try:
            n = units.parse_size(v, "memory")
        except InvalidArgument as exc:
            raise ValueError(exc.message) from None
        if n <= 0:
            raise ValueError("memory must be positive")
        return n


class HostSection(_Strict):
    proc_root: Path = Path("/proc")
    sys_root: Path = Path("/sys")


class _BackendChoice(BaseModel):
    """A section that names a backend and may carry one options table per backend
    (``[vmm.qemu]``, ``[supervisor.direct]``): switching backends is one line, and each
    backend gets only its own table.  Scalars other than the declared keys are refused
    like any unknown key; which table names are real backends is checked by the node
    against its plugin registry (`backend_tables`)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    backend: str

    @model_validator(mode="after")
    def _tables_only(self) -> _BackendChoice:
        for key, value in (self.model_extra or {}).items():
            if not isinstance(value, dict):
                raise ValueError(f"{key}: unknown key (backend options go in a table "
                                 f"[<section>.<backend>])")
        return self

    def backend_tables(self) -> dict[str, dict[str, Any]]:
        return {k: dict(v) for k, v in (self.model_extra or {}).items()}

    def options(self) -> dict[str, Any]:
        """The options table of the chosen backend (empty when there is none)."""
        return self.backend_tables().get(self.backend, {})


class VmmSection(_BackendChoice):
    """The VMM backend and the node's timing around it (docs/architecture.md)."""

    backend: str = "qemu"
    ready_timeout: float = 300.0  # unit start to the guest's hello
    stop_timeout: float = 30.0  # unit stop: SIGTERM, then SIGKILL after this
    force_sync_timeout: float = 5.0  # stop --force: the short guest sync
    monitor_interval: float = 1.0  # how often a running VMM is looked at
    artifact_dirs: list[Path] = Field(default_factory=list)

    @field_validator("ready_timeout", "stop_timeout", "force_sync_timeout",
                     "monitor_interval", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> float:
        return units.parse_duration(v)

    @field_validator("ready_timeout", "stop_timeout", "monitor_interval")
    @classmethod
    def _positive(cls, v: float) -> float:
        if v <= 0:
            raise ValueError("must be positive")
        return v

    @field_validator("artifact_dirs")
    @classmethod
    def _absolute_dirs(cls, v: list[Path]) -> list[Path]:
        for p in v:
            if not p.is_absolute():
                raise ValueError(f"artifact directory must be absolute, got {str(p)!r}")
        return v


class SupervisorSection(_BackendChoice):
    backend: str = "direct"


class TestingSection(_Strict):
    """Test inputs the node reads; see docs/dev.md.  Never needed in production."""

    clock_skew_file: Path | None = None
    #: The network namespace that stands for the host's with ``[network]``: the host
    #: ends of the Instance veths, the host table and the uplink are there.  Tests make
    #: one, so the real host's network is never changed; absent: the node's own.
    network_host_netns: Path | None = None
    #: The interpreter the egress process runs (default: the node's own), for a node
    #: whose interpreter the egress account cannot reach (a pyenv under /root), and the
    #: environment it adds (``PYTHONPATH`` to the checkout and its packages).
    egress_python: Path | None = None
    egress_environment: dict[str, str] = Field(default_factory=dict)


class NodeConfig(_Strict):
    node: NodeSection
    storage: StorageSection
    resources: ResourcesSection
    host: HostSection = Field(default_factory=HostSection)
    vmm: VmmSection = Field(default_factory=VmmSection)
    supervisor: SupervisorSection = Field(default_factory=SupervisorSection)
    #: Workspace networking (docs/network.md); absent: Instances get no network at all.
    network: NetworkSection | None = None
    plugins: PluginsSection = Field(default_factory=PluginsSection)
    testing: TestingSection = Field(default_factory=TestingSection)


# ---------------------------------------------------------------------------- loading


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


def parse(model: type[M], data: dict[str, Any], source: str) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InvalidArgument(f"invalid configuration {source}: {_describe(exc)}") from None


def load(model: type[M], path: Path | str) -> M:
    path = Path(path)
    data = read_toml(path)
    return parse(model, data, str(path))
