"""The sandbox operations both of the gateway's APIs act through: create, find (within
a team), list, connect, pause, kill, timeouts, and the reaper that ends sandboxes whose
lifetime is over.

Access is decided on ctrl's record alone: a Workspace is a team's sandbox when its
`TEAM_LABEL` says so.  Another team's sandbox, a Workspace the gateway did not make and
an ID no Workspace can have are all "not found", so a key learns nothing about other
teams' sandboxes.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from datetime import UTC, datetime
from typing import Any

import trio

from kibotos.core.errors import FailedPrecondition, InvalidArgument, KibotosError, NotFound
from kibotos.gateway.common.resume import WAKEABLE, Resumer
from kibotos.gateway.common.sandbox_labels import (
    AUTO_RESUME_LABEL,
    TRAFFIC_LABEL,
    auto_resumes,
    traffic_digest,
)
from kibotos.gateway.e2b.config import GatewayConfig
from kibotos.gateway.e2b.ctrl_client import CtrlClient, Team
from kibotos.gateway.e2b.sandboxes import (
    ENVD_VERSION,
    PAUSED_STATES,
    RUNNING_STATES,
    TEAM_LABEL,
    AccessTokens,
    Records,
    SandboxRecord,
    e2b_state,
    new_traffic_token,
    sandbox_id,
    workspace_id,
)
from kibotos.gateway.e2b.wire import EgressProxy, NetworkUpdate, NewSandbox, network_info

log = logging.getLogger("kibotos.gateway.e2b")

#: How often the reaper looks for sandboxes whose lifetime is over.
REAP_INTERVAL = 1.0
#: How often the reaper looks for auto-resume sandboxes woken by traffic (through
#: either gateway) that have no lifetime running yet, to give them a fresh one.
RENEW_INTERVAL = 5.0
#: How long a create or connect waits for the Workspace to be AVAILABLE.
READY_TIMEOUT = 600.0
_NEVER = "9999-12-31T23:59:59Z"


def _iso(unix: float | None) -> str:
    if unix is None:
        return _NEVER
    return datetime.fromtimestamp(unix, UTC).isoformat(timespec="milliseconds") \
        .replace("+00:00", "Z")


class SandboxService:
    def __init__(self, config: GatewayConfig, ctrl: CtrlClient, records: Records,
                 tokens: AccessTokens, resumer: Resumer) -> None:
        self.config = config
        self.ctrl = ctrl
        self.records = records
        self.tokens = tokens
        self.resumer = resumer

    # ------------------------------------------------------------------ finding

    async def find(self, team: Team, sid: str) -> dict[str, Any]:
        """The team's Workspace of sandbox `sid` (any state but gone)."""
        try:
            ws = await self.ctrl.workspace(workspace_id(sid))
        except NotFound:
            raise NotFound(f"sandbox {sid} not found") from None
        if ws.get("labels", {}).get(TEAM_LABEL) != team.team or e2b_state(ws["state"]) is None:
            raise NotFound(f"sandbox {sid} not found")
        return ws

    async def wait_available(self, ws: dict[str, Any]) -> dict[str, Any]:
        """Wait until the Workspace settles; AVAILABLE or an error naming its state."""
        deadline = time.monotonic() + READY_TIMEOUT
        while ws["state"] not in ("AVAILABLE", "STOPPED", "FAILED", "DELETED"):
            if time.monotonic() > deadline:
                raise FailedPrecondition(f"sandbox {sandbox_id(ws['workspace_id'])} is "
                                         f"still {ws['state']} after {READY_TIMEOUT:g}s")
            ws = await self.ctrl.workspace(ws["workspace_id"], wait_s=30)
        if ws["state"] != "AVAILABLE":
            reason = f": {ws['reason']}" if ws.get("reason") else ""
            raise FailedPrecondition(f"sandbox {sandbox_id(ws['workspace_id'])} is "
                                     f"{ws['state']}{reason}")
        return ws

    # ------------------------------------------------------------------ JSON

    def sandbox_json(self, ws: dict[str, Any], record: SandboxRecord | None) -> dict[str, Any]:
        """E2B's ``Sandbox`` (create and connect)."""
        sid = sandbox_id(ws["workspace_id"])
        out: dict[str, Any] = {
            "templateID": record.template_id if record else ws["template"]["name"],
            "sandboxID": sid, "clientID": "kibotos", "envdVersion": ENVD_VERSION,
            "envdAccessToken": self.tokens.token(sid)}
        if record is not None and record.traffic_token is not None:
            out["trafficAccessToken"] = record.traffic_token
        if self.config.domain:
            out["domain"] = self.config.domain
        return out

    def detail_json(self, ws: dict[str, Any], record: SandboxRecord | None) -> dict[str, Any]:
        """E2B's ``SandboxDetail`` / ``ListedSandbox``: without the access tokens (a get
        or a list shows no secret; create and connect hand them out)."""
        res = ws["resources"]
        shown = self.sandbox_json(ws, record)
        del shown["envdAccessToken"]
        shown.pop("trafficAccessToken", None)
        return {**shown,
                "startedAt": ws["created_at"],
                "endAt": _iso(record.end_at if record else None),
                "cpuCount": max(1, res["cpu_millis"] // 1000),
                "memoryMB": res["memory_bytes"] >> 20,
                "diskSizeMB": (ws["layer"]["size_bytes"] or 0) >> 20,
                "state": e2b_state(ws["state"]),
                "metadata": dict(record.metadata) if record else {},
                **_lifecycle_json(ws, record), **_network_json(record)}

    # ------------------------------------------------------------------ writes

    async def _put(self, record: SandboxRecord) -> None:
        """Write a record (fsync and rename) off the event loop."""
        await trio.to_thread.run_sync(self.records.put, record)

    def _seconds(self, timeout: int | None) -> int:
        seconds = self.config.sandbox.default_timeout_s if timeout is None else timeout
        cap = self.config.sandbox.max_timeout_s
        if cap and seconds > cap:
            raise InvalidArgument(f"timeout {seconds}s is longer than this gateway allows "
                                  f"({cap}s)")
        return int(seconds)

    def _end_at(self, timeout: int | None) -> float:
        return time.time() + self._seconds(timeout)

    async def create(self, team: Team, body: NewSandbox) -> dict[str, Any]:
        missing = body.unsupported()
        if missing:
            raise InvalidArgument(f"not supported by this kibotos gateway: "
                                  f"{', '.join(missing)}")
        auto_resume = body.auto_resumes()
        end_at = self._end_at(body.timeout)
        request: dict[str, Any] = {
            "template": self.config.template_for(body.templateID),
            "labels": {TEAM_LABEL: team.team},
            "cpu_millis": self.config.sandbox.cpu_millis,
            "memory_bytes": self.config.sandbox.memory_bytes,
            "layer_size_bytes": self.config.sandbox.layer_size_bytes}
        proxy = body.network.egressProxy if body.network else None
        egress = None if proxy is None else await self._create_egress(proxy)
        network = _network(body, egress)
        if network is not None:
            request["network"] = network
        traffic_token = None if body.public_traffic() else new_traffic_token()
        if traffic_token is not None:
            request["labels"][TRAFFIC_LABEL] = traffic_digest(traffic_token)
        if auto_resume:
            request["labels"][AUTO_RESUME_LABEL] = "true"
        try:
            ws = await self.ctrl.create_workspace(request)
        except KibotosError:
            if egress is not None:
                await self._delete_egress(egress)
            raise
        sid = sandbox_id(ws["workspace_id"])
        record = SandboxRecord(
            sandbox_id=sid, team=team.team, template_id=body.templateID,
            metadata=dict(body.metadata or {}), env_vars=dict(body.envVars or {}),
            end_at=end_at, on_timeout="pause" if body.autoPause else "kill",
            auto_resume=auto_resume, traffic_token=traffic_token, egress=egress,
            timeout_s=self._seconds(body.timeout), network=_asked_network(body),
            allow_internet_access=body.allow_internet_access)
        await self._put(record)
        log.info("sandbox %s created for key %s (team %s)", sid, team.key_id, team.team)
        try:
            ws = await self.wait_available(ws)
        except KibotosError:
            await self._delete(sid)
            raise
        return self.sandbox_json(ws, record)

    async def connect(self, team: Team, sid: str, timeout: int) -> tuple[bool, dict[str, Any]]:
        """(resumed, Sandbox): a paused sandbox is started (its layer was kept)."""
        ws = await self.find(team, sid)
        record = self.records.get(sid)
        if record is not None:
            end_at = self._end_at(timeout)
            if record.end_at is None or record.end_at < end_at:
                record.end_at, record.timeout_s = end_at, self._seconds(timeout)
                await self._put(record)
        resumed = ws["state"] in PAUSED_STATES
        if ws["state"] == "STOPPING":
            ws = await self.ctrl.workspace(ws["workspace_id"], wait_s=60)
        if ws["state"] == "STOPPED":
            ws = await self.ctrl.act(ws["workspace_id"], "start")
        ws = await self.wait_available(ws)
        return resumed, self.sandbox_json(ws, record)

    async def set_timeout(self, team: Team, sid: str, timeout: int) -> None:
        await self.find(team, sid)
        record = self.records.get(sid) or SandboxRecord(sid, team.team, "")
        record.end_at, record.timeout_s = self._end_at(timeout), self._seconds(timeout)
        await self._put(record)

    async def pause(self, team: Team, sid: str, memory: bool | None) -> None:
        if memory:
            raise InvalidArgument("a memory snapshot is not supported by this kibotos "
                                  "gateway: pause(mode=\"filesystem\") keeps the files")
        ws = await self.find(team, sid)
        if ws["state"] not in RUNNING_STATES:
            return
        await self.ctrl.act(ws["workspace_id"], "stop")
        record = self.records.get(sid)
        if record is not None and record.end_at is not None:
            # a paused sandbox's lifetime is not running: a connect (or, with
            # autoResume, a wake) gives it a new one, and an old end must not pause
            # or kill it again right after it is woken
            record.end_at = None
            await self._put(record)

    async def wake_if_paused(self, sid: str) -> bool:
        """Start the sandbox if it is paused and was created with ``autoResume``, and
        wait until it is AVAILABLE (one wake however many calls ask); False if it
        is not a sandbox to wake.  The caller has checked its access already."""
        ws = await self.ctrl.workspace(workspace_id(sid))
        if not auto_resumes(ws.get("labels") or {}) or ws["state"] not in WAKEABLE:
            return False
        await self.resumer.wake(ws["workspace_id"])
        await self._renew(sid)
        return True

    async def _renew(self, sid: str) -> None:
        """A woken sandbox's fresh lifetime: the timeout it was last given."""
        record = self.records.get(sid)
        if record is None or record.end_at is not None:
            return
        record.end_at = self._end_at(record.timeout_s)
        await self._put(record)
        log.info("sandbox %s: woken, its lifetime is %gs again", sid,
                 record.end_at - time.time())

    async def kill(self, team: Team, sid: str) -> None:
        await self.find(team, sid)
        await self._delete(sid)

    async def _delete(self, sid: str) -> None:
        """Kill: stop at once (ctrl deletes only a stopped Workspace), then delete."""
        record = self.records.get(sid)
        egress = record.egress if record is not None else None
        with contextlib.suppress(NotFound):  # gone already: what a kill wants
            ws = await self.ctrl.workspace(workspace_id(sid))
            if ws["state"] in RUNNING_STATES:
                ws = await self.ctrl.act(ws["workspace_id"], "stop", force=True)
            deadline = time.monotonic() + READY_TIMEOUT
            ws = await self._wait_until(sid, ws, ("STOPPED", "FAILED", "DELETING", "DELETED"),
                                        deadline)
            if ws["state"] in ("STOPPED", "FAILED"):
                ws = await self.ctrl.act(ws["workspace_id"], "delete")
            if egress is not None:
                # ctrl keeps an Egress while a Workspace that is not DELETED names it
                await self._wait_until(sid, ws, ("DELETED",), deadline)
        if egress is not None:
            await self._delete_egress(egress)
        await trio.to_thread.run_sync(self.records.drop, sid)

    async def _wait_until(self, sid: str, ws: dict[str, Any], states: tuple[str, ...],
                          deadline: float) -> dict[str, Any]:
        """`ws` as ctrl gives it once in one of `states` (long-polled), or a
        FailedPrecondition naming the state it is still in at `deadline`."""
        while ws["state"] not in states:
            if time.monotonic() > deadline:
                raise FailedPrecondition(f"sandbox {sid} is still {ws['state']}")
            ws = await self.ctrl.workspace(ws["workspace_id"], wait_s=30)
        return ws

    async def update_network(self, team: Team, sid: str, body: NetworkUpdate) -> None:
        """Replace the sandbox's egress configuration while it runs (ctrl's
        set-network: in force when it returns, connections kept).  A new
        ``egressProxy`` is a new Egress; the one it replaces is deleted once the
        Workspace no longer names it."""
        missing = body.unsupported()
        if missing:
            raise InvalidArgument(f"not supported by this kibotos gateway: "
                                  f"{', '.join(missing)}")
        ws = await self.find(team, sid)
        record = self.records.get(sid) or SandboxRecord(sid, team.team, "")
        egress = None if body.egressProxy is None \
            else await self._create_egress(body.egressProxy)
        policy = _policy(body.allow_internet_access, body.allowOut, body.denyOut, egress)
        try:
            await self.ctrl.act(ws["workspace_id"], "set-network", network=policy)
        except KibotosError:
            if egress is not None:
                await self._delete_egress(egress)
            raise
        old, record.egress = record.egress, egress
        public = (record.network or {}).get("allowPublicTraffic")
        record.network = network_info(body.allowOut, body.denyOut, body.dnsServers, public,
                                      body.egressProxy)
        record.allow_internet_access = body.allow_internet_access
        await self._put(record)
        if old is not None:
            await self._delete_egress(old)

    # ------------------------------------------------------------------ egress proxies

    async def _create_egress(self, proxy: EgressProxy) -> str:
        """The sandbox's own Egress (``e2b-`` and random hex) for its `egressProxy`:
        ctrl checks the address and seals the password; the node steers the guest's
        TCP through it and fails closed.  A refusal names the option."""
        name = f"e2b-{secrets.token_hex(8)}"
        body: dict[str, Any] = {"name": name, "address": proxy.address}
        if proxy.username is not None:
            body["username"] = proxy.username
        if proxy.password is not None:
            body["password"] = proxy.password
        try:
            await self.ctrl.create_egress(body)
        except InvalidArgument as exc:
            raise InvalidArgument(f"network.egressProxy: {exc.message}") from None
        log.info("egress %s created for a sandbox's egressProxy", name)
        return name

    async def _delete_egress(self, name: str) -> None:
        with contextlib.suppress(NotFound):
            await self.ctrl.delete_egress(name)

    # ------------------------------------------------------------------ lifetimes

    async def reap_forever(self) -> None:
        """End every sandbox whose lifetime is over: kill (delete) or pause (stop).
        Each runs in a task of its own (a kill waits for the stop), at most one per
        sandbox at a time."""
        busy: set[str] = set()

        async def expire(record: SandboxRecord) -> None:
            try:
                await self._expire(record)
            except KibotosError as exc:
                log.warning("sandbox %s: its lifetime ended, but %s failed: %s",
                            record.sandbox_id, record.on_timeout, exc.message)
            finally:
                busy.discard(record.sandbox_id)

        async with trio.open_nursery() as nursery:
            next_renew = time.monotonic() + RENEW_INTERVAL
            while True:
                await trio.sleep(REAP_INTERVAL)
                now = time.time()
                for record in self.records.all():
                    if record.end_at is None or record.end_at > now \
                            or record.sandbox_id in busy:
                        continue
                    busy.add(record.sandbox_id)
                    nursery.start_soon(expire, record)
                if time.monotonic() >= next_renew:
                    next_renew = time.monotonic() + RENEW_INTERVAL
                    try:
                        await self._renew_woken(busy)
                    except KibotosError as exc:
                        log.warning("auto-resume sandboxes: cannot list them: %s",
                                    exc.message)

    async def _renew_woken(self, busy: set[str]) -> None:
        """Give a fresh lifetime to every auto-resume sandbox that runs without one:
        woken by traffic through the Exposure gateway (or another process), which
        keeps no records.  One list call, whatever the number of sandboxes."""
        waiting = {r.sandbox_id for r in self.records.all()
                   if r.auto_resume and r.end_at is None and r.sandbox_id not in busy}
        token: str | None = None
        while waiting:
            page = await self.ctrl.workspaces(
                labels={AUTO_RESUME_LABEL: "true"}, states=list(RUNNING_STATES),
                page_size=500, page_token=token)
            for ws in page.get("workspaces", []):
                sid = sandbox_id(ws["workspace_id"])
                if sid in waiting and sid not in busy:
                    waiting.discard(sid)
                    await self._renew(sid)
            token = page.get("next_page_token")
            if not token:
                break

    async def _expire(self, record: SandboxRecord) -> None:
        sid = record.sandbox_id
        if record.on_timeout == "kill":
            log.info("sandbox %s: lifetime over, killing it", sid)
            await self._delete(sid)
            return
        log.info("sandbox %s: lifetime over, pausing it", sid)
        try:
            ws = await self.ctrl.workspace(workspace_id(sid))
        except NotFound:
            await trio.to_thread.run_sync(self.records.drop, sid)
            return
        if ws["state"] in RUNNING_STATES:
            await self.ctrl.act(ws["workspace_id"], "stop")
        record.end_at = None
        await self._put(record)


def _asked_network(body: NewSandbox) -> dict[str, Any] | None:
    net = body.network
    if net is None:
        return None
    return network_info(net.allowOut, net.denyOut, net.dnsServers, net.allowPublicTraffic,
                        net.egressProxy)


def _network_json(record: SandboxRecord | None) -> dict[str, Any]:
    """E2B's ``network`` and ``allow_internet_access`` of a detail, when they were
    asked for (the record keeps them as asked; no password)."""
    out: dict[str, Any] = {}
    if record is not None and record.network is not None:
        out["network"] = dict(record.network)
    if record is not None and record.allow_internet_access is not None:
        out["allow_internet_access"] = record.allow_internet_access
    return out


def _lifecycle_json(ws: dict[str, Any], record: SandboxRecord | None) -> dict[str, Any]:
    """E2B's ``lifecycle`` and, for a paused sandbox whose pause is done, its
    ``pauseMode``: always ``filesystem`` (a kibotos pause keeps the layer, not memory)."""
    out: dict[str, Any] = {"lifecycle": {
        "onTimeout": record.on_timeout if record else "kill",
        "autoResume": auto_resumes(ws.get("labels") or {})}}
    if ws["state"] == "STOPPED":
        out["pauseMode"] = "filesystem"
    return out


def _network(body: NewSandbox, egress: str | None) -> dict[str, Any] | None:
    """The network policy asked for, or None (the deployment's default)."""
    net = body.network
    allow = net.allowOut if net else None
    deny = net.denyOut if net else None
    if body.allow_internet_access is None and allow is None and deny is None \
            and egress is None:
        return None
    return _policy(body.allow_internet_access, allow, deny, egress)


def _policy(internet: bool | None, allow: list[str] | None, deny: list[str] | None,
            egress: str | None) -> dict[str, Any]:
    """A Workspace network policy of E2B's options.  With an `egress` the guest's TCP
    goes through it (after ``allow_out``/``deny_out``, as E2B's proxy), its other
    traffic follows ``allow_internet_access``."""
    policy: dict[str, Any] = {"public_egress": internet is not False}
    if egress is not None:
        policy["egress"] = egress
    if allow is not None:
        policy["allow_out"] = list(allow)
    if deny is not None:
        policy["deny_out"] = list(deny)
    return policy
