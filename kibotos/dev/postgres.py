"""A PostgreSQL server of its own under a directory, from Debian's ``postgresql``
package: the store of ``kibotos dev cluster up --store postgresql`` (several ctrl
replicas share it, docs/replicas.md) and of the tests' ``postgres`` fixtures.

PostgreSQL refuses to run as root, so as root the server runs as the ``postgres`` user
the package creates, in a directory handed to that user.  ``fast`` turns durability off
(``fsync``, synchronous commit, full-page writes): for throwaway test servers only.
"""

from __future__ import annotations

import glob
import os
import pwd
import socket
import subprocess
import tempfile
from pathlib import Path

from kibotos.core.errors import FailedPrecondition

#: The directories made under /tmp for a server run as root (see `PostgresServer.start`).
TMP_PREFIX = "kibotos-pg-"


def bindir() -> Path | None:
    """The newest server installed by Debian's postgresql package, if any."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(Path(p).parent.parent.name))
    return Path(found[-1]).parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    """One server: its data, socket and log under `directory` (created if missing)."""

    def __init__(self, directory: Path, *, fast: bool = False) -> None:
        found = bindir()
        if found is None:
            raise FailedPrecondition("PostgreSQL is not installed (apt-get install "
                                     "postgresql)")
        self.bindir = found
        self.link = directory
        self._at(directory.resolve() if directory.is_symlink() else directory)
        self.fast = fast
        self.prefix: list[str] = []
        if os.geteuid() == 0:
            self.prefix = ["runuser", "-u", "postgres", "--"]

    def _at(self, directory: Path) -> None:
        """Work in `directory` (the real path: never through a link root's own
        directories lead to, which the ``postgres`` user may not pass)."""
        self.dir = directory
        self.data = directory / "data"
        self.log = directory / "server.log"
        self.port_file = directory / "port"

    def _run(self, *argv: str, check: bool = True) -> int:
        proc = subprocess.run([*self.prefix, *argv], capture_output=True, text=True,
                              timeout=120, check=False, cwd=self.dir)
        if check and proc.returncode != 0:
            extra = self.log.read_text()[-3000:] if self.log.exists() else ""
            raise FailedPrecondition(f"{' '.join(argv)} failed ({proc.returncode}):\n"
                                     f"{proc.stdout}{proc.stderr}{extra}")
        return proc.returncode

    @property
    def port(self) -> int:
        return int(self.port_file.read_text())

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        """initdb at the first start, then start the server on a free loopback port.
        As root, a `directory` that does not exist yet becomes a link to a new one
        under /tmp (`TMP_PREFIX`): the ``postgres`` user may not be able to reach a
        path under root's directories."""
        if self.prefix and not self.link.exists() and not self.link.is_symlink():
            self.link.parent.mkdir(parents=True, exist_ok=True)
            self.link.symlink_to(tempfile.mkdtemp(prefix=TMP_PREFIX))
            self._at(self.link.resolve())
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.prefix:
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        if not self.data.exists():
            self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres",
                      "-A", "trust", "-E", "UTF8", *(["--no-sync"] if self.fast else []))
        self.port_file.write_text(f"{_free_port()}\n")
        opts = (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 "
                "-c max_connections=200")
        if self.fast:
            opts += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.log),
                  "-o", opts, "-w", "-t", "60", "start")

    def running(self) -> bool:
        return self.data.exists() and self._run(
            str(self.bindir / "pg_ctl"), "-D", str(self.data), "status", check=False) == 0

    def stop(self, *, immediate: bool = False) -> None:
        if self.running():
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m",
                      "immediate" if immediate else "fast", "-w", "stop")

    def create_database(self, name: str) -> str:
        """Create database `name` unless it exists; its URL."""
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                                 (name,)).fetchone()
            if found is None:
                conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)
