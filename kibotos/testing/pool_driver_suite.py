"""`check_pool_driver`: the conformance suite of the storage-pool driver seam
(`kibotos.backends.StorageDriver`), for the built-in ``local``, ``nfs`` and
``cloud-nas`` and for any third-party driver.

A driver judges a pool from what the host shows (``<proc_root>``, ``<sys_root>``, the
pool directory), so the suite cannot make a usable pool for every driver by itself: the
caller gives a `PoolMaker`, which builds in an empty directory a pool (and the host
trees it is judged by) that the driver must find usable.  From it each check derives
what the contract says of the other cases::

    def usable_pool(directory: Path) -> tuple[PoolSpec, HostPaths]:
        ...  # the pool directory, a prepared proc tree whose mounts make it usable

    @pytest.mark.parametrize("check", POOL_DRIVER_CHECKS, ids=check_id)
    def test_conformance(check, tmp_path):
        check(BackendFactory(AcmeDriver, {}), usable_pool, tmp_path)

`check_pool_driver` runs them all.  A check asserts only what `StorageDriver` and
`Availability` promise (docs/plugins.md): a verdict, never an exception, for a pool the
driver cannot use, with a reason that names the pool; nothing written into the pool;
unknown options refused.  The rules of a driver (which mount options it needs) stay in
its own tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from kibotos.backends import Availability, HostPaths, PoolSpec, StorageDriver
from kibotos.core.errors import InvalidArgument, KibotosError
from kibotos.testing.conformance import BackendFactory, check_id, expect_raises

DriverFactory = BackendFactory[StorageDriver]
#: Builds, in the (empty) directory it is given, a pool the driver must find usable.
PoolMaker = Callable[[Path], tuple[PoolSpec, HostPaths]]
PoolDriverCheck = Callable[[DriverFactory, PoolMaker, Path], None]


def _verdict(driver: StorageDriver, pool: PoolSpec, host: HostPaths) -> Availability:
    """`check`, with the shape of its answer checked."""
    verdict = driver.check(pool, host)
    assert isinstance(verdict, Availability), verdict
    assert isinstance(verdict.warnings, tuple), verdict.warnings
    assert all(isinstance(w, str) and w for w in verdict.warnings), verdict.warnings
    if verdict.available:
        assert verdict.reason is None, f"an available pool has no reason: {verdict}"
    else:
        assert isinstance(verdict.reason, str), verdict
        assert verdict.reason, verdict
        assert pool.id in verdict.reason, f"the reason must name pool {pool.id}: {verdict}"
    return verdict


def _unavailable(driver: StorageDriver, pool: PoolSpec, host: HostPaths, what: str) -> str:
    verdict = _verdict(driver, pool, host)
    assert not verdict.available, f"{what}: the driver found the pool available"
    assert verdict.reason is not None
    return verdict.reason


def _tree(path: Path) -> list[tuple[str, int]]:
    """What is in a pool directory: names and sizes, recursively."""
    return sorted((str(p.relative_to(path)), p.stat().st_size if p.is_file() else -1)
                  for p in path.rglob("*"))


# ------------------------------------------------------------------------- the checks


def check_the_class_meets_the_contract(factory: DriverFactory, make_pool: PoolMaker,
                                       scratch: Path) -> None:
    driver = factory()
    assert isinstance(driver, StorageDriver), f"{driver!r} lacks a member of the protocol"
    name = factory.cls.name
    assert isinstance(name, str), name
    assert name, "the driver's name is empty"


def check_unknown_options_are_refused(factory: DriverFactory, make_pool: PoolMaker,
                                      scratch: Path) -> None:
    """A typo in ``[[storage.pool]]`` options is an error, not silently ignored."""
    refusal = expect_raises(InvalidArgument,
                            lambda: factory.with_options(kibotos_check_no_such_option=1),
                            "an unknown option")
    assert "kibotos_check_no_such_option" in str(refusal), refusal


def check_a_usable_pool_is_available(factory: DriverFactory, make_pool: PoolMaker,
                                     scratch: Path) -> None:
    pool, host = make_pool(scratch)
    verdict = _verdict(factory(), pool, host)
    assert verdict.available, f"the pool the maker built is not available: {verdict}"


def check_the_verdict_is_repeatable(factory: DriverFactory, make_pool: PoolMaker,
                                    scratch: Path) -> None:
    """`check` runs at every availability refresh: the same host gives the same verdict,
    from the same driver object and from a new one (a restarted node)."""
    pool, host = make_pool(scratch)
    driver = factory()
    first = _verdict(driver, pool, host)
    assert _verdict(driver, pool, host) == first
    assert _verdict(factory(), pool, host) == first


def check_nothing_is_written_into_the_pool(factory: DriverFactory, make_pool: PoolMaker,
                                           scratch: Path) -> None:
    """The pool's content belongs to the node (its marker, its objects): a driver only
    looks at it."""
    pool, host = make_pool(scratch)
    (pool.path / "kibotos-check-object").write_bytes(b"x" * 10)
    before = _tree(pool.path)
    _verdict(factory(), pool, host)
    assert _tree(pool.path) == before


def check_a_missing_pool_directory_is_unavailable(factory: DriverFactory,
                                                  make_pool: PoolMaker,
                                                  scratch: Path) -> None:
    """The usual case of a pool not mounted yet: an answer, not an exception."""
    pool, host = make_pool(scratch)
    missing = dataclasses.replace(pool, path=pool.path / "not-mounted")
    reason = _unavailable(factory(), missing, host, "a pool directory that does not exist")
    assert str(missing.path) in reason, reason


def check_a_file_is_not_a_pool(factory: DriverFactory, make_pool: PoolMaker,
                               scratch: Path) -> None:
    pool, host = make_pool(scratch)
    a_file = pool.path / "a-file"
    a_file.write_text("")
    reason = _unavailable(factory(), dataclasses.replace(pool, path=a_file), host,
                          "a file instead of a directory")
    assert str(a_file) in reason, reason


def check_an_unreadable_host_is_unavailable(factory: DriverFactory, make_pool: PoolMaker,
                                            scratch: Path) -> None:
    """Without the kernel's facts (an empty ``proc`` and ``sys``) the driver cannot
    vouch for the pool: unavailable, with a reason, never an exception."""
    pool, _host = make_pool(scratch)
    empty = scratch / "kibotos-check-empty-host"
    (empty / "proc").mkdir(parents=True)
    (empty / "sys").mkdir()
    try:
        _unavailable(factory(), pool, HostPaths(proc_root=empty / "proc",
                                                sys_root=empty / "sys"),
                     "a host whose proc and sys trees are empty")
    except (OSError, KibotosError) as exc:
        raise AssertionError(f"check raised instead of answering: {exc!r}") from exc


POOL_DRIVER_CHECKS: tuple[PoolDriverCheck, ...] = (
    check_the_class_meets_the_contract,
    check_unknown_options_are_refused,
    check_a_usable_pool_is_available,
    check_the_verdict_is_repeatable,
    check_nothing_is_written_into_the_pool,
    check_a_missing_pool_directory_is_unavailable,
    check_a_file_is_not_a_pool,
    check_an_unreadable_host_is_unavailable,
)


def check_pool_driver(factory: DriverFactory, make_pool: PoolMaker, scratch: Path) -> None:
    """Every check of `POOL_DRIVER_CHECKS`, each in a fresh subdirectory of `scratch`."""
    for check in POOL_DRIVER_CHECKS:
        directory = scratch / check_id(check)
        directory.mkdir(parents=True)
        try:
            check(factory, make_pool, directory)
        except (AssertionError, KibotosError, OSError) as exc:
            raise AssertionError(f"{check.__name__}: {exc}") from exc
