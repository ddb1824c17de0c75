"""The ctrl side of bench/placement.py for one store and replica count: a PostgreSQL
server when asked (under the run's directory, as `kibotos dev cluster up --store
postgresql` starts one), replica 1 started first, then every further replica with
copies of replica 1's shared keys and the shared artifact directory, as docs/replicas.md
says operators run them.  Kept apart so placement.py stays the load and its checks."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kibotos.ctrl.replica import copy_shared_keys
from kibotos.dev.postgres import PostgresServer

#: One ctrl replica's process, URL and config path.
Spawned = tuple[subprocess.Popen[bytes], str, Path]


@dataclass
class CtrlCluster:
    """The replicas of one measurement and the PostgreSQL server behind them."""

    workdir: Path
    store: str
    postgres: PostgresServer | None = None
    replicas: list[Spawned] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [url for _, url, _ in self.replicas]

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc, _, _ in self.replicas]

    def start(self, count: int, spawn: Callable[[Path, str, Path | None, bool], Spawned]
              ) -> None:
        """Start `count` replicas; `spawn(dir, database_url, artifact_dir, first)`
        starts one ctrl whose state directory is ``dir/state``."""
        database_url, artifacts = "", None
        if self.store == "postgresql":
            # fsync on: the store as operators run it (SQLite runs synchronous=FULL).
            self.postgres = PostgresServer(self.workdir / "postgres")
            self.postgres.start()
            database_url = self.postgres.create_database("kibotos_bench")
            artifacts = self.workdir / "artifacts"
        for n in range(1, count + 1):
            replica_dir = self.workdir / f"ctrl-{n}"
            replica_dir.mkdir()
            if n > 1:
                copy_shared_keys(self.workdir / "ctrl-1" / "state", replica_dir / "state")
            self.replicas.append(spawn(replica_dir, database_url, artifacts, n == 1))

    def postgres_cpu(self) -> float:
        """CPU seconds of the PostgreSQL server and its backends so far (0 for SQLite,
        which runs inside ctrl)."""
        if self.postgres is None:
            return 0.0
        pid_file = self.postgres.data / "postmaster.pid"
        try:
            master = int(pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return 0.0
        total = 0.0
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(entry.name) == master or int(fields[1]) == master:
                # utime + stime, and the CPU of backends that already ended (cutime, cstime)
                total += sum(int(f) for f in fields[11:15]) if int(entry.name) == master \
                    else int(fields[11]) + int(fields[12])
        return total / os.sysconf("SC_CLK_TCK")

    def logs(self) -> None:
        """Print each replica's log tail (after a failed run)."""
        for n in range(1, len(self.replicas) + 1):
            log = (self.workdir / f"ctrl-{n}" / "ctrl.log").read_text(
                errors="replace").splitlines()
            print(f"ctrl-{n}.log (last 40 lines):", *log[-40:], sep="\n", file=sys.stderr)

    def stop(self, first_signal: int = signal.SIGTERM) -> None:
        """Stop every replica (replica 1 with `first_signal`: SIGUSR1 writes its
        profile), then the PostgreSQL server."""
        for n, (proc, _, _) in enumerate(self.replicas):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, first_signal if n == 0 else signal.SIGTERM)
        for proc, _, _ in self.replicas:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self.postgres is not None:
            self.postgres.stop(immediate=True)
