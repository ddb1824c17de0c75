"""What ``synchronous=FULL`` costs ctrl's SQLite store against ``NORMAL`` (issue 16):
the same commits through `kibotos.ctrl.store.db.Store` on two databases in one
directory, one per setting, alternating rounds so both see the same machine load.

    .venv/bin/python bench/store_sync.py [--dir DIR] [--commits 300] [--rounds 3]

Each commit is one small row (an event), alone (``--group 1``, a write that waits for
nothing) or with others in one transaction (``--group 15``, about what group commit
carries under placement load, bench/placement.py).  Prints commits per second of each
setting and the ratio FULL / NORMAL.  ``DIR`` should be on the disk a ctrl's state
directory lives on (a tmpfs syncs for free and shows no cost).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.orm import Session

from kibotos.ctrl.store import db


def _store(path: Path, synchronous: str) -> db.Store:
    db.SQLITE_SYNCHRONOUS = synchronous  # read when each connection opens
    store = db.Store(db.make_engine(f"sqlite:///{path}"))
    with store.engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY, "
                          "subject TEXT, detail TEXT)"))
    with store.engine.connect() as conn:  # the pool's connection, opened just now
        got = conn.execute(text("PRAGMA synchronous")).scalar()
    assert got == {"NORMAL": 1, "FULL": 2}[synchronous], got
    return store


def _rate(store: db.Store, commits: int, group: int) -> float:
    def txn(session: Session) -> None:
        for _ in range(group):
            session.execute(text("INSERT INTO events (subject, detail) VALUES "
                                 "('ws-bench', '{\"from\": \"CREATING\"}')"))

    started = time.perf_counter()
    for _ in range(commits):
        store.run_sync(txn)
    return commits / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=Path.cwd())
    parser.add_argument("--commits", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--group", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix=".store-sync-") as tmp:
        stores = {s: _store(Path(tmp) / f"{s.lower()}.db", s) for s in ("NORMAL", "FULL")}
        db.SQLITE_SYNCHRONOUS = "FULL"
        rates: dict[str, list[float]] = {s: [] for s in stores}
        for _ in range(args.rounds):
            for setting, store in stores.items():
                rates[setting].append(_rate(store, args.commits, args.group))
        for store in stores.values():
            store.close()
    best = {s: max(r) for s, r in rates.items()}
    for setting, values in rates.items():
        print(f"{setting:6} {best[setting]:8.0f} commits/s (rounds: "
              f"{', '.join(f'{v:.0f}' for v in values)})")
    print(f"FULL / NORMAL: {best['FULL'] / best['NORMAL']:.2f} of the commit rate, "
          f"{args.group} write(s) per commit")


if __name__ == "__main__":
    main()
