"""This ctrl process as one replica among several on a PostgreSQL store: its heartbeat,
the singleton lease, and the sweep that ends the sessions of replicas that are gone
(docs/replicas.md; the rows and the fencing rules are in `kibotos.ctrl.model.replicas`).

On SQLite there is one ctrl process by construction (one database file on one host),
so the lease is trivially held and nothing here touches the store: ctrl start marks
every session ended, as the previous process's sessions died with it.

On PostgreSQL a replica registers under a fresh ID, and every `Membership.interval`
renews its heartbeat and then tries the lease (ttl `lease_ttl`).  The lease holder runs
the singleton work: `Runtime.sweep` asks `holds_lease` before resuming pending
operations, and the sweep of gone replicas ends the sessions no live replica holds.
`holds_lease` is measured on this process's monotonic clock from *before* the grant's
transaction started, so it turns false no later than the database's expiry, and at once
after a SIGSTOP longer than the lease (monotonic time runs on while a process is
stopped).  A heartbeat that finds this replica's row deleted (another declared it gone:
it was stopped or cut off longer than the session timeout) closes every local session,
whose rows were ended already, so the nodes reconnect and get a session that counts;
then the replica registers again.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from pathlib import Path

import trio

from kibotos.core import atomicfile, credentials, ids
from kibotos.core.errors import KibotosError
from kibotos.ctrl.live.context import utcnow
from kibotos.ctrl.live.node_sessions import SessionHub
from kibotos.ctrl.model import replicas as rep
from kibotos.ctrl.model import session_store
from kibotos.ctrl.store import secret_box
from kibotos.ctrl.store.db import Store
from kibotos.protocol import CloseReason
from kibotos.tls import ca

log = logging.getLogger("kibotos.ctrl.replica")

#: The files of ctrl's state directory that every replica must have the same copy of:
#: the session signing key (nodes check data-plane credentials against the key the
#: welcome named), the key sealing Egress passwords in the shared store, and the
#: cluster CA (nodes and ``kibo`` pin it; each replica issues its own server
#: certificate from it).
SHARED_KEY_FILES = (credentials.KEY_FILE, secret_box.KEY_FILE, ca.KEY_FILE, ca.CERT_FILE)


def copy_shared_keys(source: Path, target: Path) -> None:
    """Give the state directory `target` the shared keys of `source` (an existing
    replica's, or the first start's), with their modes, each written atomically."""
    target.mkdir(parents=True, exist_ok=True, mode=0o700)
    for name in SHARED_KEY_FILES:
        path = source / name
        atomicfile.write_bytes(target / name, path.read_bytes(),
                               mode=os.stat(path).st_mode & 0o777)


def is_shared(store: Store) -> bool:
    """Whether several replicas may share this store (PostgreSQL)."""
    return store.engine.dialect.name == "postgresql"


class Membership:
    """This process's part in the replica set (the module docstring)."""

    def __init__(self, store: Store, hub: SessionHub, session_timeout: float,
                 listen: str) -> None:
        self.store = store
        self.hub = hub
        self.shared = is_shared(store)
        self.replica_id = ids.new_id("rep")
        self.listen = listen
        self.session_timeout = session_timeout
        #: The lease outlives its last renewal by this much: a holder that dies is
        #: replaced within ``lease_ttl + interval``, inside the session timeout.
        self.lease_ttl = session_timeout * 2 / 3
        self.interval = session_timeout / 6
        self.token: int | None = None
        self._valid_until = 0.0
        if self.shared:
            hub.replica_id = self.replica_id

    def holds_lease(self) -> bool:
        """Whether this replica may run the singleton work now."""
        if not self.shared:
            return True
        return self.token is not None and trio.current_time() < self._valid_until

    async def start(self) -> None:
        """At ctrl start, before the API serves: on SQLite end every session (the
        previous process held them all); on PostgreSQL register this replica."""
        if not self.shared:
            dead = await self.store.write(partial(session_store.mark_all_dead,
                                                  now=utcnow()))
            if dead:
                log.info("ctrl: %d sessions of the previous process marked dead", dead)
            return
        await self.store.write(partial(rep.register, replica_id=self.replica_id,
                                       listen=self.listen))
        log.info("ctrl: replica %s registered", self.replica_id)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Heartbeat, lease and gone-replica sweep until cancelled; a clean exit gives
        the lease and the replica row up."""
        task_status.started()
        if not self.shared:
            await trio.sleep_forever()
        try:
            while True:
                started = trio.current_time()
                try:
                    await self.round(started)
                except KibotosError as exc:  # the store is unreachable: try again
                    log.warning("ctrl replica %s: round failed: %s", self.replica_id, exc)
                await trio.sleep_until(started + self.interval)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await self.leave()

    async def round(self, started: float) -> None:
        """One heartbeat, one lease attempt and, as holder, one gone-replica sweep.
        `started` is the monotonic time taken before any of it."""
        if not await self.store.write(partial(rep.heartbeat, replica_id=self.replica_id)):
            log.warning("ctrl replica %s was declared gone: closing its sessions and "
                        "registering again", self.replica_id)
            self.token = None
            await self.hub.close_all(CloseReason.CTRL_SHUTDOWN)
            await self.store.write(partial(rep.register, replica_id=self.replica_id,
                                           listen=self.listen))
            return
        lease = await self.store.write(partial(rep.acquire, replica_id=self.replica_id,
                                               ttl=self.lease_ttl))
        if lease is None:
            if self.token is not None:
                log.warning("ctrl replica %s lost the lease", self.replica_id)
            self.token = None
            return
        self.token = lease.token
        self._valid_until = started + lease.ttl
        if lease.taken_over:
            log.info("ctrl replica %s holds the lease (token %d)", self.replica_id,
                     lease.token)
        ended = await self.store.write(partial(
            rep.end_sessions_of_gone_replicas, token=lease.token,
            timeout=self.session_timeout))
        if ended:
            log.info("ctrl replica %s ended the sessions of %s: their replica is gone",
                     self.replica_id, ", ".join(ended))

    async def leave(self) -> None:
        if self.token is not None:
            await self.store.write(partial(rep.release, replica_id=self.replica_id,
                                           token=self.token))
            self.token = None
        await self.store.write(partial(rep.leave, replica_id=self.replica_id))
