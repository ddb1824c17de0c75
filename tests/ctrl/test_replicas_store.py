"""A serving ctrl's store on a real PostgreSQL server, as several replicas need it: a
transaction left open by a stalled process (SIGSTOP between two statements) is aborted
by the server instead of holding its row locks, and what the stalled process meets is
`Unavailable`, like any other loss of the store (`kibotos.ctrl.store.db`); and the
loops of a replica (the runtime's rounds, the relay's wait for a record) go on after
store work that failed."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import trio
from ctrl_helpers import make_config
from sqlalchemy import select, text, update
from sqlalchemy.orm import Session

from kibotos.config import CtrlConfig
from kibotos.core.errors import Unavailable
from kibotos.ctrl import relay as relay_mod
from kibotos.ctrl.live import runtime as runtime_mod
from kibotos.ctrl.live.node_sessions import SessionHub
from kibotos.ctrl.model import replicas as rep
from kibotos.ctrl.relay import CommandRelay
from kibotos.ctrl.serve import build_context, build_services, open_store
from kibotos.ctrl.store import migrate, relay_queue
from kibotos.ctrl.store.db import SERVING_IDLE_IN_TRANSACTION_TIMEOUT, Store, make_engine
from kibotos.ctrl.store.models import CtrlReplica
from kibotos.protocol import CreateSpec
from kibotos.testing.waiting import wait_until

pytestmark = pytest.mark.postgres


async def test_a_serving_store_aborts_transactions_left_idle(
        tmp_path: Path, postgres_url: str) -> None:
    config = CtrlConfig.model_validate({"ctrl": {
        "state_dir": str(tmp_path / "ctrl"), "database_url": postgres_url}})
    store = await open_store(config)
    try:
        shown = await store.run(lambda s: str(s.execute(
            text("SHOW idle_in_transaction_session_timeout")).scalar_one()))
    finally:
        store.close()
    assert shown == f"{round(SERVING_IDLE_IN_TRANSACTION_TIMEOUT)}s"


def test_a_stalled_transaction_frees_its_row_locks_and_reads_as_unavailable(
        postgres_url: str) -> None:
    engine = make_engine(postgres_url, idle_in_transaction_timeout=0.5)
    migrate.upgrade(engine)
    store = Store(engine)
    try:
        store.run_sync(lambda s: rep.register(s, "rep-a", "before"))
        locked = threading.Event()
        met: list[BaseException | None] = []

        def stalled(session: Session) -> None:
            session.execute(update(CtrlReplica).values(listen="stalled write"))
            locked.set()
            time.sleep(2)  # stopped, holding the row's lock
            session.execute(select(1))

        def run_stalled() -> None:
            try:
                store.run_sync(stalled)
            except BaseException as exc:  # checked below
                met.append(exc)
            else:
                met.append(None)

        thread = threading.Thread(target=run_stalled)
        thread.start()
        try:
            assert locked.wait(30)
            # Another replica's write of the same row goes ahead once the server
            # aborted the stalled transaction (it would wait forever otherwise; the
            # lock_timeout only bounds this test).
            def other(session: Session) -> None:
                session.execute(text("SET LOCAL lock_timeout = '20s'"))
                session.execute(update(CtrlReplica).values(listen="other replica"))
            store.run_sync(other)
        finally:
            thread.join(60)
        assert len(met) == 1
        assert isinstance(met[0], Unavailable), met[0]
        listens = store.run_sync(lambda s: list(s.scalars(select(CtrlReplica.listen))))
        assert listens == ["other replica"]
        # The store serves on: the aborted connection is not reused.
        assert store.run_sync(lambda s: s.execute(select(1)).scalar_one()) == 1
    finally:
        store.close()


async def test_the_runtime_loop_survives_a_round_whose_store_work_fails(
        tmp_path: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep whose store work fails (here a statement the server refuses) is logged,
    and the next round runs: `Runtime.run` ending would end ctrl."""
    monkeypatch.setattr(runtime_mod, "SWEEP_INTERVAL", 0.05)
    store = await open_store(make_config(tmp_path, postgres_url))
    try:
        services = build_services(build_context(make_config(tmp_path, postgres_url), store))
        runtime = services.runtime
        rounds: list[str] = []

        async def flaky() -> None:
            if not rounds:
                rounds.append("failed")
                await store.run(lambda s: s.execute(text("SELECT 1 / 0")))
            rounds.append("ran")

        runtime.add_sweeper(flaky)
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.run)
            await wait_until(lambda: rounds.count("ran") >= 2 or None,
                             "two sweeps after the failed one", timeout=30)
            assert runtime.running
            nursery.cancel_scope.cancel()
        assert rounds[0] == "failed"
    finally:
        store.close()


async def test_a_store_error_while_the_relay_waits_for_a_record_is_retried(
        tmp_path: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The holder's wait for a relayed create's record meets a store error: it looks
    again instead of raising in the relay's nursery (which would end ctrl)."""
    store = await open_store(make_config(tmp_path, postgres_url))
    try:
        ctx = build_context(make_config(tmp_path, postgres_url), store)
        assert isinstance(ctx.sessions, SessionHub)
        inflight: dict[str, trio.Event] = {}
        relay = CommandRelay(store, ctx.sessions, "rep-a", lambda _batch: None, inflight)
        looks: list[str] = []

        def instance_known(session: Session, instance_id: str) -> bool:
            looks.append(instance_id)
            if len(looks) == 1:
                session.execute(text("SELECT 1 / 0"))  # the store refuses this look
            return len(looks) >= 3

        async def accepted(_queued: relay_queue.Queued) -> bool:
            return True

        monkeypatch.setattr(relay_mod.tx, "instance_known", instance_known)
        monkeypatch.setattr(relay, "_send_and_store", accepted)
        queued = relay_queue.Queued(relay_id="rly-1", node_id="node-a",
                                    kind=CreateSpec.KIND,
                                    args={"instance_id": "inst-1"}, timeout_s=30.0)
        with trio.fail_after(20):
            await relay._send(queued)
        assert looks == ["inst-1"] * 3
        assert inflight == {}
    finally:
        store.close()
