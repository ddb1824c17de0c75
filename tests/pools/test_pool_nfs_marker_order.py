"""The NFS writeback limit as the pool monitor applies it (spec/storage-pools-on-nfs.txt,
"Notes"): only after the pool's marker check passes, and again at every check (the
setting lives until a remount, which resets it)."""

from __future__ import annotations

from pathlib import Path

from nfs_trees import DEVICE, make_host

from kibotos.config import PoolSection
from kibotos.node.storage.pools.availability import PoolMonitor
from kibotos.node.storage.pools.marker import MISSING_REASON, init_pool
from kibotos.plugins import load_plugins

GOOD = "rw,relatime,vers=4.1,hard,proto=tcp"


def test_the_limit_waits_for_the_marker_and_is_set_again_at_every_check(tmp_path: Path
                                                                       ) -> None:
    host, pool = make_host(tmp_path, GOOD)
    bdi = host.sys_root / "class" / "bdi" / DEVICE
    section = PoolSection.model_validate({"id": "pool-a", "path": str(pool), "driver": "nfs"})
    mon = PoolMonitor([section], load_plugins().storage_driver, host)

    mon.refresh()  # no marker: not this pool's storage, nothing on the host is changed
    assert mon.unavailable_reason("pool-a") == MISSING_REASON
    assert (bdi / "max_bytes").read_text().strip() == str(4 * 2**30)
    assert (bdi / "strict_limit").read_text().strip() == "0"

    init_pool("pool-a", pool, adopt=True)
    mon.refresh()
    assert mon.available("pool-a")
    assert (bdi / "max_bytes").read_text().strip() == str(256 * 2**20)
    assert (bdi / "strict_limit").read_text().strip() == "1"

    (bdi / "max_bytes").write_text(f"{4 * 2**30}\n")  # a remount resets the device
    (bdi / "strict_limit").write_text("0\n")
    mon.refresh()
    assert (bdi / "max_bytes").read_text().strip() == str(256 * 2**20)
    assert (bdi / "strict_limit").read_text().strip() == "1"
