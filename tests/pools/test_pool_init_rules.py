"""`kibotos-node storage-pool init` and the marker: every rule of "Initializing a pool"
and the ID rules of "File names and object IDs" (spec: storage-pools-on-nfs)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kibotos.cli.roles.node_role_cmds import node_role_group
from kibotos.core.errors import FailedPrecondition, InvalidArgument
from kibotos.node.storage.pools.marker import (
    MARKER_NAME,
    MISSING_REASON,
    MarkerProblem,
    check_marker,
    init_pool,
    rfc3339_ns,
)


def run_init(*args: str):
    return CliRunner().invoke(node_role_group, ["storage-pool", "init", *args],
                              catch_exceptions=False)


def test_marker_has_the_spec_shape(tmp_path: Path):
    pool = tmp_path / "pool-a"
    result = run_init("--id", "pool-a", "--path", str(pool))
    assert result.exit_code == 0, result.output
    marker = json.loads((pool / MARKER_NAME).read_text())
    assert set(marker) == {"version", "pool_id", "instance", "created_at"}
    assert marker["version"] == 1
    assert marker["pool_id"] == "pool-a"
    assert re.fullmatch(r"[0-9a-f]{32}", marker["instance"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z", marker["created_at"])
    assert marker["instance"] in result.output
    # no temporary file left beside it
    assert sorted(os.listdir(pool)) == [MARKER_NAME]


def test_rfc3339_ns_keeps_nanoseconds():
    assert rfc3339_ns(1_789_676_423_084_208_280) == "2026-09-17T20:20:23.084208280Z"


def test_missing_directory_is_created(tmp_path: Path):
    pool = tmp_path / "a" / "b" / "pool"
    res = init_pool("pool-b", pool)
    assert res.created
    assert pool.is_dir()
    assert check_marker("pool-b", pool).instance == res.marker.instance


def test_non_empty_directory_needs_adopt(tmp_path: Path):
    pool = tmp_path / "pool"
    (pool / "volumes").mkdir(parents=True)
    (pool / "retained-layers").mkdir()
    result = run_init("--id", "pool-c", "--path", str(pool))
    assert result.exit_code == 13
    assert "not empty" in result.output
    assert "--adopt" in result.output
    assert not (pool / MARKER_NAME).exists()
    result = run_init("--id", "pool-c", "--path", str(pool), "--adopt")
    assert result.exit_code == 0, result.output
    assert (pool / "volumes").is_dir()  # data kept
    assert check_marker("pool-c", pool).pool_id == "pool-c"


def test_init_again_with_same_id_changes_nothing(tmp_path: Path):
    pool = tmp_path / "pool"
    first = init_pool("pool-d", pool)
    before = (pool / MARKER_NAME).read_bytes()
    (pool / "volumes").mkdir()  # no longer empty: still fine, it is initialized
    result = run_init("--id", "pool-d", "--path", str(pool))
    assert result.exit_code == 0, result.output
    assert "already initialized" in result.output
    assert (pool / MARKER_NAME).read_bytes() == before
    assert init_pool("pool-d", pool).marker == first.marker


def test_other_id_on_initialized_path_is_refused_and_marker_kept(tmp_path: Path):
    pool = tmp_path / "pool"
    init_pool("pool-e", pool)
    before = (pool / MARKER_NAME).read_bytes()
    for adopt in ((), ("--adopt",)):
        result = run_init("--id", "pool-f", "--path", str(pool), *adopt)
        assert result.exit_code == 13
        assert "'pool-e'" in result.output
        assert "'pool-f'" in result.output
        assert (pool / MARKER_NAME).read_bytes() == before


def test_invalid_marker_is_never_overwritten(tmp_path: Path):
    pool = tmp_path / "pool"
    pool.mkdir()
    (pool / MARKER_NAME).write_text("{broken")
    with pytest.raises(FailedPrecondition, match="storage pool marker is invalid"):
        init_pool("pool-g", pool, adopt=True)
    assert (pool / MARKER_NAME).read_text() == "{broken"


@pytest.mark.parametrize("bad", ["..", "a/b", "Pool-A", "-pool", "pool-", "p" * 64,
                                 "pool a", ""])
def test_bad_ids_are_refused_before_anything_is_written(tmp_path: Path, bad: str):
    pool = tmp_path / "new"
    result = run_init("--id", bad, "--path", str(pool))
    assert result.exit_code == 10, result.output
    assert "invalid pool ID" in result.output
    assert not pool.exists()
    with pytest.raises(InvalidArgument):
        init_pool(bad, pool)
    assert not pool.exists()


def test_relative_path_is_refused(tmp_path: Path):
    with pytest.raises(InvalidArgument, match="absolute"):
        init_pool("pool-h", Path("relative/pool"))


def test_init_does_not_read_the_node_config(tmp_path: Path):
    """Through the real entry point, with no config anywhere: it needs none."""
    pool = tmp_path / "pool"
    proc = subprocess.run(
        [sys.executable, "-c", "from kibotos.cli.main import kibotos_node_main as m; m()",
         "storage-pool", "init", "--id", "pool-i", "--path", str(pool)],
        capture_output=True, text=True, env={**os.environ, "HOME": str(tmp_path)},
        cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr
    assert check_marker("pool-i", pool).pool_id == "pool-i"


def test_check_marker_reasons(tmp_path: Path):
    pool = tmp_path / "pool"
    pool.mkdir()
    with pytest.raises(MarkerProblem) as missing:
        check_marker("pool-j", pool)
    assert missing.value.reason == MISSING_REASON
    init_pool("other", pool, adopt=True)
    with pytest.raises(MarkerProblem) as other:
        check_marker("pool-j", pool)
    assert other.value.reason.startswith("storage pool marker is invalid")
    assert "'other'" in other.value.reason
    assert "'pool-j'" in other.value.reason
    for content in ('{"version": 2}', "[]", '{"version": 1, "pool_id": "pool-j", '
                    '"instance": "XYZ", "created_at": "2026-01-01T00:00:00.0Z"}'):
        (pool / MARKER_NAME).write_text(content)
        with pytest.raises(MarkerProblem, match="storage pool marker is invalid"):
            check_marker("pool-j", pool)
