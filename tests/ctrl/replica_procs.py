"""ctrl replicas as real ``kibotos ctrl serve`` processes on one PostgreSQL database, for
the failover tests: each with its own state directory holding copies of the first's
shared keys (`kibotos.ctrl.replica.copy_shared_keys`), its log in a file."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from sqlalchemy import select
from sqlalchemy.orm import Session

from kibotos.config import CtrlConfig
from kibotos.ctrl.replica import copy_shared_keys
from kibotos.ctrl.serve import LISTEN_ADDRESS_FILE
from kibotos.ctrl.store.db import Store
from kibotos.ctrl.store.models import CtrlLease, Node
from kibotos.testing.waiting import wait_until
from kibotos.tls.local_ctrl import ctrl_url


@dataclass
class Replica:
    name: str
    config: CtrlConfig
    proc: trio.Process
    log: Path
    url: str = ""

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


async def start_replica(tmp_path: Path, name: str, database_url: str,
                        keys_from: Path | None, session_timeout: str) -> Replica:
    """Start one replica and wait until it listens; `keys_from` is the state directory
    whose shared keys it gets (None: the first, which makes them)."""
    state = tmp_path / name
    if keys_from is not None:
        copy_shared_keys(keys_from, state)
    config_path = tmp_path / f"{name}.toml"
    config_path.write_text(
        f'[ctrl]\nlisten = "127.0.0.1:0"\nstate_dir = "{state}"\n'
        f'database_url = "{database_url}"\nsession_timeout = "{session_timeout}"\n'
        '[testing]\npool_capacity = "1T"\n')
    log = tmp_path / f"{name}.log"
    with log.open("wb") as out:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "kibotos.cli.main", "ctrl", "serve", "--config",
             str(config_path)],
            stdout=subprocess.DEVNULL, stderr=out)
    config = CtrlConfig.model_validate({"ctrl": {"listen": "127.0.0.1:0",
                                                 "state_dir": str(state),
                                                 "database_url": database_url}})
    replica = Replica(name, config, proc, log)
    address_file = state / LISTEN_ADDRESS_FILE

    def listening() -> bool:
        if proc.returncode is not None:
            raise AssertionError(f"replica {name} exited: {replica.log_text()}")
        return address_file.exists()

    await wait_until(listening, f"replica {name} listens", timeout=60)
    replica.url = ctrl_url(config, address_file.read_text().strip())
    return replica


async def stop_all(replicas: list[Replica]) -> None:
    for replica in replicas:
        if replica.proc.returncode is None:
            replica.proc.kill()
            await replica.proc.wait()


async def lease(store: Store) -> tuple[str | None, int]:
    def read(session: Session) -> tuple[str | None, int]:
        row = session.get(CtrlLease, "singleton")
        assert row is not None
        return row.holder, row.token
    return await store.run(read)


async def sessions(store: Store) -> dict[str, dict[str, Any]]:
    """Every node's session as the store has it."""
    def read(session: Session) -> dict[str, dict[str, Any]]:
        return {n.node_id: {"alive": n.session_alive, "session_id": n.session_id,
                            "replica": n.session_replica}
                for n in session.scalars(select(Node))}
    return await store.run(read)
