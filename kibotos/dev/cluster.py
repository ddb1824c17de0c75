"""A whole cluster on loopback: one ctrl and N nodes as real processes under one DIR.

This is a newcomer's first step (`kibotos dev cluster up`) and the harness of the
end-to-end tests (`DevCluster` in Python).  It drives only public surfaces: the config
files, ``kibotos ctrl serve``/``grant``, ``kibo enroll``, ``kibotos node serve`` and the
HTTP API, so a test through it exercises what an operator would run.

The orchestration is synchronous (subprocesses, polling with generous deadlines): it is
a command-line tool and a pytest fixture, with nothing to run concurrently.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from kibotos import config
from kibotos.cli.core import kibo_config
from kibotos.core import atomicfile, errors
from kibotos.dev import gateway as e2b_gateway
from kibotos.dev import layout as lay
from kibotos.dev.postgres import PostgresServer
from kibotos.dev.procs import DEFAULT_GRACE, START_MARK, Service, Supervisor, tail
from kibotos.dev.units import stop_vmm_units
from kibotos.egress.wire import socket_dir_of
from kibotos.tls import local_ctrl
from kibotos.tls.contexts import client_context

T = TypeVar("T")

_GRANT = re.compile(r"kgr-[A-Za-z0-9]+[.][A-Za-z0-9_=-]+")
POLL = 0.2


class ClusterError(errors.FailedPrecondition):
    """The cluster could not be brought into the asked state; the message says why."""


def script(name: str) -> str:
    """The console script `name` of the running installation (the venv's bin first)."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    return name  # found on PATH by subprocess


@dataclass(frozen=True)
class ProcessStatus:
    name: str  # "ctrl" or the node ID
    pid: int | None  # running PID, None when not running
    node_status: str | None  # status ctrl derives for a node, None if unknown

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "pid": self.pid, "running": self.pid is not None,
                "node_status": self.node_status}


class DevCluster:
    """ctrl and nodes under `directory`; the same object serves the CLI and the tests."""

    def __init__(self, directory: Path | str, *, timeout: float = 60.0) -> None:
        self.dir = Path(directory).absolute()
        self.layout = lay.Layout(self.dir)
        self.timeout = timeout
        self._sup = Supervisor()

    # ------------------------------------------------------------------ services

    def ctrl_service(self, replica: int = 1) -> Service:
        d = self.layout.replica_dir(replica)
        cfg = d / "ctrl.toml"
        name = "ctrl" if replica == 1 else f"ctrl-{replica}"
        return Service(name, (script("kibotos"), "ctrl", "serve", "--config", str(cfg)),
                       cfg, d / "ctrl.log", d / "ctrl.pid")

    def ctrl_services(self) -> list[Service]:
        """Every ctrl replica (one unless ``--ctrl-replicas``)."""
        return [self.ctrl_service(n) for n in self.layout.replica_numbers()]

    def node_service(self, node_id: str) -> Service:
        d = self.layout.node_dir(node_id)
        cfg = self.layout.node_config(node_id)
        return Service(node_id, (script("kibotos"), "node", "serve", "--config", str(cfg)),
                       cfg, d / "node.log", d / "node.pid")

    def gateway_service(self) -> Service:
        """The E2B gateway (`start_e2b_gateway`), a service once its config exists."""
        return e2b_gateway.service(self.dir, script("kibotos"))

    def gateway_services(self) -> list[Service]:
        """The gateways started (E2B, Exposure): those whose config exists."""
        both = [self.gateway_service(), e2b_gateway.exposure_service(self.dir,
                                                                     script("kibotos"))]
        return [svc for svc in both if svc.config.exists()]

    def services(self) -> list[Service]:
        return [*self.ctrl_services(), *(self.node_service(n) for n in self.node_ids()),
                *self.gateway_services()]

    def node_ids(self) -> list[str]:
        return self.layout.node_ids()

    def running(self) -> list[str]:
        """Names of the services of this cluster that run now."""
        return [s.name for s in self.services() if self._sup.pid(s) is not None]

    # ------------------------------------------------------------------ up / down

    def up(self, nodes: int = 3, *, shared_pool: bool = False, cpu: str = "4",
           memory: str = "8G", reconcile_interval: str | None = None,
           session_timeout: str | None = None, test_inputs: bool = False,
           node_env: Mapping[str, str] | None = None, vmm_backend: str | None = None,
           shared_default: bool = False, vmm_options: Mapping[str, Any] | None = None,
           store: str = "sqlite", ctrl_replicas: int = 1,
           network: Mapping[str, Any] | None = None,
           node_testing: Mapping[str, Any] | None = None,
           log: Callable[[str], None] = lambda _msg: None) -> None:
        """Start ctrl and `nodes` nodes and wait until every node is READY.

        `vmm_backend` sets the nodes' ``[vmm] backend`` (tests: ``testvmm``, with
        `node_env` naming the test plugin module and its path; `vmm_options` its
        ``[vmm.<backend>]`` table); `shared_default` makes
        the shared pool every node's default pool, so new Workspaces can move.
        `store` ``postgresql`` starts a PostgreSQL server under DIR/postgres for ctrl;
        `ctrl_replicas` > 1 (PostgreSQL only) starts that many ctrl replicas, the nodes
        spread over them and DIR/kibo.toml listing them all (docs/replicas.md).
        `network` is every node's ``[network]`` table (docs/network.md), so Workspaces
        get a network and may name Egresses; `node_testing` adds keys to the nodes'
        ``[testing]`` (tests: ``network_host_netns``, a namespace standing in for the
        host's, and ``egress_python``; docs/dev.md).

        On failure everything started is stopped again and the files are kept for a
        look at the logs; the error names the failing process, its status and log tail.
        """
        if nodes < 1:
            raise errors.InvalidArgument(f"--nodes must be at least 1, got {nodes}")
        if store not in ("sqlite", "postgresql"):
            raise errors.InvalidArgument(f"--store must be sqlite or postgresql, got {store!r}")
        if ctrl_replicas < 1 or (ctrl_replicas > 1 and store != "postgresql"):
            raise errors.InvalidArgument(
                f"--ctrl-replicas {ctrl_replicas}: several replicas need --store postgresql"
                if ctrl_replicas > 1 else "--ctrl-replicas must be at least 1")
        if self.running():
            raise ClusterError(f"a dev cluster is already running in {self.dir} "
                               f"({', '.join(self.running())}); stop it with "
                               f"`kibotos dev cluster down --dir {self.dir}`")
        if self.dir.exists() and any(self.dir.iterdir()):
            raise ClusterError(f"{self.dir} is not empty: it holds a stopped cluster or other "
                               "files; remove it or choose another --dir")
        config.parse(config.ResourcesSection, {"cpu": cpu, "memory": memory}, "--cpu/--memory")
        deadline = time.monotonic() + self.timeout
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            database_url = ""
            if store == "postgresql":
                server = PostgresServer(self.layout.postgres_dir)
                log(f"starting PostgreSQL (log {server.log})")
                server.start()
                database_url = server.create_database("kibotos")
            lay.write_ctrl_config(self.layout, listen="127.0.0.1:0",
                                  reconcile_interval=reconcile_interval,
                                  session_timeout=session_timeout, database_url=database_url)
            log(f"starting ctrl (log {self.ctrl_service().log})")
            url = self.start_ctrl(deadline=deadline)
            self._pin_ctrl_port(url)
            log(f"ctrl is up at {url}; enrolling the operator into {self.layout.kibo_config}")
            self._enroll_operator(url)
            urls = [url]
            for replica in range(2, ctrl_replicas + 1):
                lay.write_replica_config(self.layout, replica)
                log(f"starting ctrl replica {replica} (log {self.ctrl_service(replica).log})")
                urls.append(self.start_ctrl(deadline=deadline, replica=replica))
                self._pin_ctrl_port(urls[-1], replica)
            if len(urls) > 1:
                self._list_replicas_for_kibo(urls)
            ids = [f"node-{i}" for i in range(1, nodes + 1)]
            for i, node_id in enumerate(ids):
                # Node i starts on replica i mod N and lists the others after it, so a
                # replica that stops takes its nodes' sessions to the next one.
                k = i % len(urls)
                node_urls: str | list[str] = urls[k:] + urls[:k] if len(urls) > 1 \
                    else urls[0]
                lay.write_node_config(self.layout, node_id, ctrl_url=node_urls,
                                      cpu=cpu,
                                      ctrl_ca_file=self.ctrl_ca_file(),
                                      memory=memory, shared_pool=shared_pool,
                                      test_inputs=test_inputs, vmm_backend=vmm_backend,
                                      shared_default=shared_default,
                                      vmm_options=vmm_options, network=network,
                                      testing=node_testing)
                token = self._node_grant(node_id)
                atomicfile.write_bytes(self.layout.node_dir(node_id) / "grant",
                                       token.encode() + b"\n", mode=0o600)
                self.start_node(node_id, env=node_env)
            log(f"started {', '.join(ids)}; waiting until every node is READY")
            self.wait_ready(ids, deadline=deadline)
        except BaseException:
            self.down(grace=5.0)
            raise

    def down(self, grace: float = DEFAULT_GRACE) -> list[str]:
        """Stop every process of this cluster (nodes first, each with the data-plane
        processes and VMM units it started, which outlive a node by design); return the
        names of the node and ctrl processes and of the VMM units stopped.  The E2B
        and Exposure gateways, clients of both, stop first."""
        gateways = self.gateway_services()
        stopped = self._sup.stop(gateways, grace) if gateways else []
        nodes = [self.node_service(n) for n in self.node_ids()]
        stopped += self._sup.stop(nodes, grace)
        for svc in nodes:
            self._stop_dataplane(svc)
            self._stop_egress(svc)
            stopped += stop_vmm_units(svc.config, timeout=grace)
        stopped += self._sup.stop(self.ctrl_services(), grace)
        if self.layout.postgres_dir.is_dir():
            PostgresServer(self.layout.postgres_dir).stop()
        return stopped

    def _stop_dataplane(self, svc: Service) -> list[str]:
        """``kibotos dataplane stop`` for one node: its data-plane units end; returns
        their names."""
        if not svc.config.exists():
            return []
        stdout = self._stop_units(svc, "dataplane", "the data plane")
        sockets = config.load(config.NodeConfig, svc.config).node.socket_dir
        if sockets.name.startswith(lay.SHORT_SOCKET_DIR_PREFIX):  # outside DIR: ours to clear
            shutil.rmtree(sockets, ignore_errors=True)
        return [line.removeprefix("stopped ") for line in stdout.splitlines()
                if line.startswith("stopped ")]

    def _stop_units(self, svc: Service, role: str, what: str) -> str:
        """``kibotos ROLE stop`` for one node (units that outlive it, as VMMs do);
        its output."""
        done = subprocess.run([script("kibotos"), role, "stop", "--config",
                               str(svc.config), "--timeout", "5"],
                              capture_output=True, text=True, timeout=self.timeout,
                              check=False)
        if done.returncode != 0:
            raise ClusterError(f"stopping {what} of {svc.name} failed: "
                               f"{done.stderr.strip()[-300:]}")
        return done.stdout

    def _stop_egress(self, svc: Service) -> None:
        """``kibotos egress stop`` for a node with ``[network]``: its egress processes
        (units that outlive a node, like the VMMs) end, and their socket directory
        goes."""
        if not svc.config.exists():
            return
        node = config.load(config.NodeConfig, svc.config)
        if node.network is None:
            return
        self._stop_units(svc, "egress", "the egress processes")
        egress_dir = socket_dir_of(node.node.socket_dir)
        if egress_dir.name.startswith(lay.SHORT_SOCKET_DIR_PREFIX):
            shutil.rmtree(egress_dir, ignore_errors=True)

    def status(self) -> list[ProcessStatus]:
        """Each process: its PID if it runs, and the node status from ctrl if reachable."""
        if not self.layout.exists():
            raise errors.NotFound(f"{self.dir} holds no dev cluster")
        ctrl = self.ctrl_service()
        ctrl_pid = self._sup.pid(ctrl)
        statuses: dict[str, str] = {}
        if ctrl_pid is not None and self.layout.kibo_config.exists():
            try:
                for n in self.api("GET", "/v1/nodes", params={"page_size": 500})["nodes"]:
                    statuses[n["node_id"]] = n["status"]
            except (errors.KibotosError, httpx.HTTPError, KeyError, TypeError):
                pass  # ctrl unreachable or not answering: status unknown
        out = [ProcessStatus("ctrl", ctrl_pid, None)]
        out += [ProcessStatus(svc.name, self._sup.pid(svc), None)
                for svc in self.ctrl_services()[1:]]
        for node_id in self.node_ids():
            pid = self._sup.pid(self.node_service(node_id))
            out.append(ProcessStatus(node_id, pid, statuses.get(node_id)))
        for gateway in self.gateway_services():
            out.append(ProcessStatus(gateway.name, self._sup.pid(gateway), None))
        return out

    # ------------------------------------------------------------------ E2B gateway

    def start_e2b_gateway(self, *, templates: Mapping[str, str] | None = None,
                          default_timeout_s: int = 300, memory_bytes: int = 512 << 20,
                          layer_size_bytes: int = 1 << 30, exposure: bool = True
                          ) -> e2b_gateway.GatewayUrls:
        """Start the E2B gateway (docs/gateways.md) and, with `exposure`, the Exposure
        gateway, each with its own operator identity; wait until they listen, create an
        API key of team ``default`` and write DIR/e2b.env.  `templates` are the E2B
        gateway's aliases (default: ``base`` is ``kibotos-base``)."""
        e2b_gateway.write_config(
            self, templates=dict(templates or e2b_gateway.DEFAULT_TEMPLATES),
            default_timeout_s=default_timeout_s, memory_bytes=memory_bytes,
            layer_size_bytes=layer_size_bytes)
        api, sandbox = self._start_gateway(self.gateway_service(), exposure=False)
        exposure_url = None
        if exposure:
            e2b_gateway.write_exposure_config(self)
            exposure_url, _ = self._start_gateway(
                e2b_gateway.exposure_service(self.dir, script("kibotos")), exposure=True)
        key = e2b_gateway.api_key(self, "dev", "default")
        urls = e2b_gateway.GatewayUrls(api, sandbox, key, self.dir / "e2b.env",
                                       exposure_url)
        e2b_gateway.write_env(self.dir, urls)
        return urls

    def _start_gateway(self, svc: Service, *, exposure: bool) -> tuple[str, str]:
        self._sup.start(svc)
        try:
            return e2b_gateway.wait_listening(
                self.dir, lambda: self._sup.exit_status(svc.name),
                time.monotonic() + self.timeout, exposure=exposure)
        except RuntimeError as exc:
            self._sup.stop([svc], 5.0)
            raise ClusterError(str(exc)) from None

    # ------------------------------------------------------------------ ctrl

    @property
    def ctrl_url(self) -> str:
        return kibo_config.load(self.layout.kibo_config).ctrl_url

    def start_ctrl(self, *, deadline: float | None = None,
                   env: Mapping[str, str] | None = None, replica: int = 1) -> str:
        """Start ctrl (replica `replica`) and wait for its listen address and
        ``/v1/health``; return its URL."""
        deadline = deadline or time.monotonic() + self.timeout
        svc = self.ctrl_service(replica)
        if self._sup.pid(svc) is not None:
            raise ClusterError(f"{svc.name} of {self.dir} is already running")
        address_file = self._listen_address_file(replica)
        address_file.unlink(missing_ok=True)
        self._sup.start(svc, env)
        address = self._wait(
            lambda: self._read_listen_address(address_file), deadline,
            lambda: f"{svc.name} wrote no {address_file}", svc)
        ctrl_config = config.load(config.CtrlConfig, svc.config)
        url = local_ctrl.ctrl_url(ctrl_config, address)

        def healthy() -> bool:
            try:
                return httpx.get(f"{url}/v1/health", timeout=5.0,
                                 verify=local_ctrl.client_tls(ctrl_config)).status_code == 200
            except httpx.HTTPError:
                return False

        self._wait(healthy, deadline, lambda: f"ctrl at {url} does not answer /v1/health", svc)
        return url

    def stop_ctrl(self, grace: float = DEFAULT_GRACE) -> None:
        self._sup.stop([self.ctrl_service()], grace)

    def _listen_address_file(self, replica: int) -> Path:
        if replica == 1:
            return self.layout.listen_address_file
        return self.layout.replica_dir(replica) / "state" / self.layout.listen_address_file.name

    def _list_replicas_for_kibo(self, urls: list[str]) -> None:
        """Make DIR/kibo.toml's ``ctrl_url`` the list of every replica's URL."""
        path = self.layout.kibo_config
        listed = "ctrl_url = [" + ", ".join(f'"{u}"' for u in urls) + "]"
        text = re.sub(r"(?m)^ctrl_url = .*$", lambda _m: listed, path.read_text(), count=1)
        atomicfile.write_bytes(path, text.encode(), mode=0o600)

    def restart_ctrl(self, *, wait_nodes: bool = True) -> None:
        """Stop ctrl (SIGTERM) and start it again on the same address; by default wait
        until every running node has a live control session again."""
        self.stop_ctrl()
        self.start_ctrl()
        if wait_nodes:
            deadline = time.monotonic() + self.timeout
            for node_id in self.node_ids():
                if self._sup.pid(self.node_service(node_id)) is not None:
                    self._wait_one(node_id, None, deadline)

    def _read_listen_address(self, address_file: Path) -> str | None:
        try:
            text = address_file.read_text().strip()
        except FileNotFoundError:
            return None
        return text or None

    def _pin_ctrl_port(self, url: str, replica: int = 1) -> None:
        """Rewrite ctrl.toml with the port ctrl bound, so a restart keeps the address."""
        path = self.ctrl_service(replica).config
        with open(path, "rb") as f:
            doc = tomllib.load(f)
        doc["ctrl"]["listen"] = url.split("://", 1)[1].rstrip("/")
        lay.write_config(path, config.CtrlConfig, doc, lay.CTRL_HEADER)

    def _enroll_operator(self, url: str) -> None:
        grant = self._run([script("kibotos"), "ctrl", "grant", "--config",
                           str(self.layout.ctrl_config), "--kind", "operator"], "operator grant")
        token = _GRANT.search(grant.stdout)
        if token is None:
            raise ClusterError(f"`kibotos ctrl grant` printed no grant token: {grant.stdout!r}")
        ca = self.ctrl_ca_file()
        self._run([script("kibo"), "enroll", "--ctrl-url", url, "--grant", token.group(0),
                   *(["--ca-file", str(ca)] if ca is not None else []),
                   "--config", str(self.layout.kibo_config)], "operator enrollment")

    def ctrl_ca_file(self) -> Path | None:
        """The CA file clients verify this cluster's ctrl against (its cluster CA;
        None when ctrl serves an operator's certificate or plain HTTP)."""
        return local_ctrl.ca_file(config.load(config.CtrlConfig, self.layout.ctrl_config))

    def _node_grant(self, node_id: str) -> str:
        result = self.api("POST", "/v1/enrollment/grants",
                          json={"kind": "node", "node_id": node_id,
                                "name": f"dev cluster {node_id}"})
        return str(result["token"])

    # ------------------------------------------------------------------ nodes

    def start_node(self, node_id: str, *, env: Mapping[str, str] | None = None) -> int:
        """Start ``kibotos node serve`` for `node_id` (detached); return its PID."""
        svc = self.node_service(node_id)
        if not svc.config.exists():
            raise errors.NotFound(f"this cluster has no node {node_id!r}")
        if self._sup.pid(svc) is not None:
            raise ClusterError(f"node {node_id} is already running")
        return self._sup.start(svc, env)

    def kill_node(self, node_id: str, sig: int = signal.SIGKILL, *,
                  wait: bool = True) -> int | None:
        """Send `sig` to the node's process.  For SIGKILL/SIGTERM/SIGINT (with `wait`),
        wait until it has exited and return its exit status if this object started it."""
        svc = self.node_service(node_id)
        pid = self._sup.signal(svc, sig)
        if pid is None:
            raise ClusterError(f"node {node_id} is not running")
        if wait and sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            if not self._sup.wait_exit(svc, pid, self.timeout):
                raise ClusterError(f"node {node_id} (pid {pid}) did not exit after {sig!s}")
            return self._sup.exit_status(node_id)
        return None

    def wait_node_exit(self, node_id: str, timeout: float | None = None) -> int | None:
        """Wait until the node's process exits on its own; its exit status if known."""
        svc = self.node_service(node_id)
        pid = self._sup.pid(svc)
        if pid is not None and not self._sup.wait_exit(svc, pid, timeout or self.timeout):
            raise errors.DeadlineExceeded(f"node {node_id} still runs after "
                                          f"{timeout or self.timeout:.0f}s")
        return self._sup.exit_status(node_id)

    def node_log(self, node_id: str, *, current_run: bool = True) -> str:
        """The node's log; by default only what its latest start wrote."""
        svc = self.node_service(node_id)
        try:
            text = svc.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        if current_run:
            start = text.rfind(START_MARK)
            return text[start:] if start >= 0 else text
        return text

    def node(self, node_id: str) -> dict[str, Any]:
        """The Node record ctrl has for `node_id` (``GET /v1/nodes/{id}``)."""
        result = self.api("GET", f"/v1/nodes/{node_id}")
        assert isinstance(result, dict)
        return result

    def wait_ready(self, node_ids: Iterable[str] | None = None, *,
                   deadline: float | None = None) -> None:
        """Wait until each node is READY in ctrl, or fail naming the node and why."""
        self.wait_status(node_ids, "READY", deadline=deadline)

    def wait_status(self, node_ids: Iterable[str] | None, status: str, *,
                    deadline: float | None = None) -> None:
        """Wait until each node has `status` in ctrl.  Waiting for READY fails at once
        when the node's process exits."""
        deadline = deadline or time.monotonic() + self.timeout
        for node_id in list(node_ids) if node_ids is not None else self.node_ids():
            self._wait_one(node_id, status, deadline)

    def _wait_one(self, node_id: str, status: str | None, deadline: float) -> None:
        """Wait for `status`, or with None for a live control session (any status)."""
        last = "no record in ctrl yet"

        def reached() -> bool:
            nonlocal last
            try:
                rec = self.node(node_id)
            except errors.NotFound:
                return False
            session = rec.get("latest_session") or {}
            last = (f"status {rec.get('status')}, control session "
                    f"{'alive' if session.get('alive') else 'not alive'}")
            if status is None:
                return bool(session.get("alive"))
            return bool(rec.get("status") == status)

        svc = self.node_service(node_id) if status in ("READY", None) else None
        goal = status or "connected"
        self._wait(reached, deadline, lambda: f"node {node_id} is not {goal}: {last}", svc)

    # ------------------------------------------------------------------ API and CLI

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        """One operator request to ctrl with the credential in DIR/kibo.toml; the
        ``result``, or the `KibotosError` ctrl answered with."""
        cfg = kibo_config.load(self.layout.kibo_config)
        headers = {"Authorization": f"Bearer {cfg.credential}"} if cfg.credential else {}
        r = httpx.request(method, cfg.ctrl_url.rstrip("/") + path, headers=headers,
                          verify=client_context(cfg.ctrl_ca),
                          timeout=30.0, **kwargs)
        try:
            body = r.json()
        except ValueError:
            raise errors.Internal(f"{method} {path}: HTTP {r.status_code}, not JSON: "
                                  f"{r.text[:200]!r}") from None
        if r.status_code >= 400:
            raise errors.error_from_wire(body)
        return body["result"]

    def kibo(self, *args: str, input: str | None = None, timeout: float = 120.0,
             env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run the real ``kibo`` console script against this cluster."""
        full_env = {**os.environ, "KIBO_CONFIG": str(self.layout.kibo_config),
                    "COLUMNS": "250", **(env or {})}
        return subprocess.run([script("kibo"), *args], input=input, capture_output=True,
                              text=True, timeout=timeout, env=full_env, check=False)

    # ------------------------------------------------------------------ helpers

    def _run(self, argv: list[str], what: str) -> subprocess.CompletedProcess[str]:
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout,
                                  stdin=subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired:
            raise ClusterError(f"{what}: `{' '.join(argv)}` took over "
                               f"{self.timeout:.0f}s") from None
        if proc.returncode != 0:
            raise ClusterError(f"{what} failed (exit {proc.returncode}): "
                               f"{(proc.stderr or proc.stdout).strip()}")
        return proc

    def _wait(self, probe: Callable[[], T | bool | None], deadline: float,
              why: Callable[[], str], svc: Service | None) -> T:
        """Poll `probe` until it returns a truthy value; fail at `deadline`, or at once
        when `svc` (whose process must keep running) has exited."""
        while True:
            value = probe()
            if value:
                return value  # type: ignore[return-value]
            if svc is not None and self._sup.pid(svc) is None:
                code = self._sup.exit_status(svc.name)
                how = "" if code is None else f" with status {code}"
                raise ClusterError(f"{why()}; its process has exited{how}. "
                                   f"Last lines of {svc.log}:\n{tail(svc.log)}")
            if time.monotonic() >= deadline:
                where = f" Last lines of {svc.log}:\n{tail(svc.log)}" if svc else ""
                raise errors.DeadlineExceeded(f"{why()} after {self.timeout:.0f}s.{where}")
            time.sleep(POLL)
