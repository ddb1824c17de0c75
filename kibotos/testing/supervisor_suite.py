"""`check_supervisor`: the conformance suite of the supervisor seam
(`kibotos.backends.Supervisor`), for the built-in ``direct`` and ``systemd`` and for any
third-party supervisor.

Each check is an async function of a `BackendFactory` (each call builds a new supervisor
object over the same units, as a restarted node does) and a scratch directory it may
write into.  `SUPERVISOR_CHECKS` lists them, so a test can run each as its own case::

    @pytest.mark.parametrize("check", SUPERVISOR_CHECKS, ids=check_id)
    async def test_conformance(check, tmp_path):
        await check(BackendFactory(AcmeSupervisor, {"state_dir": str(tmp_path / "u")}),
                    tmp_path)

or `check_supervisor` runs them all in order.  What the suite needs of the host: the
units run in the test's PID namespace (it reads ``/proc/<MainPID>``), ``sh``, ``sleep``
and ``true`` on the default ``PATH``, and the factory must pickle (the class importable,
the options plain data): one check builds the supervisor in a separate process that
is then killed.  Each check names its units ``kibotos-check-<check>-…`` and stops them
when it ends, passed or not.

A check asserts only what `kibotos.backends.Supervisor` and `UnitInfo` promise.  What a
supervisor does beyond that (``direct``'s records, systemd's unit properties, how the
exit status is named) stays in that supervisor's own tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import trio

from kibotos.backends import Supervisor, UnitInfo, UnitSpec
from kibotos.core.errors import AlreadyExists, FailedPrecondition, InvalidArgument, KibotosError
from kibotos.testing.conformance import BackendFactory, check_id, expect_raises_async
from kibotos.testing.waiting import wait_until

SupervisorFactory = BackendFactory[Supervisor]
SupervisorCheck = Callable[[SupervisorFactory, Path], Awaitable[None]]

#: Bounds every wait of the suite: long on a loaded machine, never a timed assertion.
DEADLINE = 60.0
#: The ``PATH`` a unit gets when its spec sets none (`UnitSpec`).
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: The unit properties the VMM backends ask for (spec, "VMM service"): every supervisor
#: must start a unit that carries them, honouring or recording each.
VMM_PROPERTIES = {"Type": "exec", "Restart": "no", "KillMode": "control-group",
                  "OOMPolicy": "kill", "Slice": "kibotos-vmm.slice", "PrivateMounts": False,
                  "Description": "kibotos conformance check"}


# ------------------------------------------------------------------------- /proc facts


def _stat_fields(pid: int) -> list[str]:
    """Fields 3… of ``/proc/<pid>/stat`` (after the command name in parentheses)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2:].split()


def alive(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie)."""
    try:
        return _stat_fields(pid)[0] not in "ZXx"
    except (OSError, IndexError):
        return False


@dataclass(frozen=True)
class ProcessFacts:
    """What ``/proc/<pid>`` says of a process, read in one go (a unit's main process)."""

    start_time_ticks: int
    executable: str
    executable_dev_ino: tuple[int, int]
    cgroups: frozenset[str]
    netns_inode: int
    environ: tuple[bytes, ...]
    cwd: str

    @classmethod
    def of(cls, pid: int) -> ProcessFacts:
        proc = Path(f"/proc/{pid}")
        executable = os.path.realpath(proc / "exe")
        st = os.stat(executable)
        return cls(
            start_time_ticks=int(_stat_fields(pid)[19]),  # field 22
            executable=executable,
            executable_dev_ino=(st.st_dev, st.st_ino),
            cgroups=frozenset(line.split(":", 2)[2]
                              for line in (proc / "cgroup").read_text().splitlines()),
            netns_inode=os.stat(proc / "ns" / "net").st_ino,
            environ=tuple((proc / "environ").read_bytes().split(b"\0")),
            cwd=os.readlink(proc / "cwd"),
        )


def _which(program: str) -> str:
    for directory in DEFAULT_PATH.split(":"):
        candidate = Path(directory) / program
        if os.access(candidate, os.X_OK):
            return os.path.realpath(candidate)
    raise AssertionError(f"{program} is not on {DEFAULT_PATH}: the suite needs it")


# ------------------------------------------------------------------------- helpers


def _unit(check: str, name: str) -> str:
    return f"kibotos-check-{check}-{name}.service"


@contextlib.asynccontextmanager
async def _units(factory: SupervisorFactory, check: str) -> AsyncIterator[Supervisor]:
    """A supervisor for one check; every unit of the check is stopped afterwards."""
    supervisor = factory()
    try:
        yield supervisor
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(DEADLINE):
            for info in await factory().list(f"kibotos-check-{check}-"):
                await supervisor.stop(info.name, timeout=1)


async def _inactive(supervisor: Supervisor, name: str) -> UnitInfo | None:
    """The unit once its main process is gone: inactive, or forgotten (None)."""

    async def settled() -> tuple[UnitInfo | None] | None:
        info = await supervisor.describe(name)
        return (info,) if info is None or not info.active else None

    (info,) = await wait_until(settled, f"unit {name} to become inactive",
                               timeout=DEADLINE)
    return info


def _read(path: Path, containing: str = "") -> str | None:
    """The text of a file a unit writes, once it exists (and holds `containing`)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return text if text and containing in text else None


def _pids(path: Path, count: int) -> list[int] | None:
    """The PIDs a unit's script wrote to `path`, one a line, once there are `count`."""
    words = (_read(path) or "").split()
    return [int(w) for w in words] if len(words) == count else None


def _sleeper(name: str) -> UnitSpec:
    return UnitSpec(name=name, argv=["sleep", "1000"])


# ------------------------------------------------------------------------- the checks


async def check_start_reports_the_process(factory: SupervisorFactory, scratch: Path) -> None:
    """`start` returns once the main process runs, with every identity fact of it as
    ``/proc`` has it; `describe` says the same."""
    async with _units(factory, "identity") as sup:
        name = _unit("identity", "one")
        info = await sup.start(_sleeper(name))
        assert info.name == name, info
        assert info.active, info
        assert info.result is None, info
        assert info.argv == ("sleep", "1000"), info.argv
        pid = info.main_pid
        assert pid is not None, info
        assert alive(pid), info
        facts = ProcessFacts.of(pid)
        assert info.start_time_ticks == facts.start_time_ticks, "start time (field 22)"
        assert facts.executable == _which("sleep"), facts.executable
        assert info.executable == facts.executable, info.executable
        assert info.executable_dev_ino == facts.executable_dev_ino, info.executable_dev_ino
        assert info.cgroup in facts.cgroups, (info.cgroup, facts.cgroups)
        assert info.netns_inode == facts.netns_inode, info.netns_inode
        assert info.invocation_id is not None, info
        assert len(info.invocation_id) == 32, info.invocation_id
        int(info.invocation_id, 16)
        assert f"INVOCATION_ID={info.invocation_id}".encode() in facts.environ
        assert await sup.describe(name) == info


async def check_start_applies_the_spec(factory: SupervisorFactory, scratch: Path) -> None:
    """Properties are taken, argv reaches the program unchanged, the environment is the
    spec's alone (PATH defaulted), the working directory is the spec's, and stdout and
    stderr go to the log file."""
    async with _units(factory, "spec") as sup:
        log = scratch / "spec-logs" / "unit.log"
        env_file = scratch / "spec-env.txt"
        workdir = scratch / "spec-cwd"
        workdir.mkdir()
        script = (f'echo "out $KIBOTOS_CHECK"; echo "argument: $1"; echo err >&2; '
                  f"env > {env_file}.tmp && mv {env_file}.tmp {env_file}; exec sleep 1000")
        # Reaches the program as it is: no supervisor expands variables in argv.
        literal = "$KIBOTOS_CHECK $$ ${PATH}"
        leak = "KIBOTOS_CHECK_NODE_SECRET"
        os.environ[leak] = "leaked"
        try:
            info = await sup.start(UnitSpec(
                name=_unit("spec", "env"), argv=["sh", "-c", script, "sh", literal],
                properties=VMM_PROPERTIES, environment={"KIBOTOS_CHECK": "a b=c"},
                working_directory=workdir, log_path=log))
        finally:
            del os.environ[leak]
        assert info.active, info
        env = await wait_until(lambda: _read(env_file), "the unit's environment dump",
                               timeout=DEADLINE)
        assert leak not in env, "the node's environment leaked into the unit"
        assert "KIBOTOS_CHECK=a b=c" in env.splitlines()
        assert f"PATH={DEFAULT_PATH}" in env.splitlines()
        text = await wait_until(lambda: _read(log, containing="err"),
                                "stdout and stderr in the log", timeout=DEADLINE)
        assert "out a b=c" in text
        assert f"argument: {literal}" in text.splitlines()
        assert info.argv == ("sh", "-c", script, "sh", literal)
        assert info.main_pid is not None
        assert ProcessFacts.of(info.main_pid).cwd == str(workdir)


async def check_a_new_supervisor_lists_and_adopts(factory: SupervisorFactory,
                                                  scratch: Path) -> None:
    """A new supervisor object (a restarted node) lists the units by prefix, sees the
    same facts, and can stop them."""
    async with _units(factory, "adopt") as sup:
        first = await sup.start(_sleeper(_unit("adopt", "vmm-a")))
        await sup.start(_sleeper(_unit("adopt", "vmm-b")))
        await sup.start(_sleeper(_unit("adopt", "egress-a")))
        again = factory()
        listed = await again.list("kibotos-check-adopt-vmm-")
        assert sorted(i.name for i in listed) == [_unit("adopt", "vmm-a"),
                                                  _unit("adopt", "vmm-b")], listed
        assert all(i.active for i in listed), listed
        assert next(i for i in listed if i.name == first.name) == first
        everything = {i.name for i in await again.list("kibotos-check-adopt-")}
        assert _unit("adopt", "egress-a") in everything
        assert await again.list("kibotos-check-adopt-nothing") == []
        await again.stop(first.name, timeout=5)
        assert await sup.describe(first.name) is None
        assert first.main_pid is not None
        assert not alive(first.main_pid)


_STARTER = textwrap.dedent("""
    import json, pickle, sys, trio
    from kibotos.backends import UnitSpec

    async def main():
        factory = pickle.loads(sys.stdin.buffer.read())
        info = await factory().start(UnitSpec(name=sys.argv[1], argv=["sleep", "1000"]))
        print(json.dumps(info.main_pid), flush=True)
        await trio.sleep_forever()

    trio.run(main)
""")


async def check_units_outlive_their_starter(factory: SupervisorFactory,
                                            scratch: Path) -> None:
    """A separate "node" process starts a unit and is killed with SIGKILL: the unit
    lives on, and this process (the next node) finds it."""
    try:
        pickled = pickle.dumps(factory)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise AssertionError(f"the factory must pickle for this check: {exc}") from exc
    name = _unit("outlive", "orphan")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    async with _units(factory, "outlive") as sup:
        node = await trio.lowlevel.open_process(
            [sys.executable, "-c", _STARTER, name], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env, start_new_session=True)
        try:
            assert node.stdin is not None
            assert node.stdout is not None
            await node.stdin.send_all(pickled)
            await node.stdin.aclose()
            line = b""
            with trio.fail_after(DEADLINE):
                while not line.endswith(b"\n"):
                    chunk = await node.stdout.receive_some()
                    assert chunk, f"the starter process exited without a unit: {line!r}"
                    line += chunk
            pid = int(json.loads(line))
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
            with trio.CancelScope(shield=True):
                await node.wait()
                if node.stdout is not None:
                    await node.stdout.aclose()
        info = await sup.describe(name)
        assert info is not None, "the unit of a killed starter is gone"
        assert info.active, info
        assert info.main_pid == pid
        assert alive(pid)


async def check_a_killed_main_process_ends_the_unit(factory: SupervisorFactory,
                                                    scratch: Path) -> None:
    """SIGKILL of the main process: the unit is inactive with a result and without
    process facts, keeps its invocation ID, and its name can be started again."""
    async with _units(factory, "killed") as sup:
        name = _unit("killed", "victim")
        info = await sup.start(_sleeper(name))
        assert info.main_pid is not None
        os.kill(info.main_pid, signal.SIGKILL)
        dead = await _inactive(sup, name)
        assert dead is not None, "a unit killed by a signal must stay known until stop"
        assert isinstance(dead.result, str), dead
        assert dead.result, dead
        assert (dead.main_pid, dead.start_time_ticks) == (None, None), dead
        assert dead.invocation_id == info.invocation_id
        assert [(i.name, i.active) for i in await sup.list(name)] == [(name, False)]
        again = await sup.start(_sleeper(name))
        assert again.active
        assert again.invocation_id != info.invocation_id


async def check_a_failing_unit_is_inactive(factory: SupervisorFactory, scratch: Path) -> None:
    """A unit whose main process exits at once with a failure ends up inactive with a
    result, until `stop` forgets it."""
    async with _units(factory, "fails") as sup:
        name = _unit("fails", "sad")
        info = await sup.start(UnitSpec(name=name, argv=["sh", "-c", "exit 3"]))
        assert info.invocation_id is not None
        ended = await _inactive(sup, name)
        assert ended is not None, "a failed unit must stay known until stop"
        assert isinstance(ended.result, str), ended
        assert ended.result, ended
        await sup.stop(name, timeout=5)
        assert await sup.describe(name) is None


async def check_stop_terminates_first(factory: SupervisorFactory, scratch: Path) -> None:
    """`stop` sends SIGTERM first and returns once the unit is gone and forgotten."""
    marker, ready = scratch / "terminated", scratch / "handler-ready"
    code = textwrap.dedent(f"""
        import pathlib, signal, sys, time
        def term(*_):
            pathlib.Path({str(marker)!r}).write_text("SIGTERM")
            sys.exit(0)
        signal.signal(signal.SIGTERM, term)
        pathlib.Path({str(ready)!r}).write_text("")
        while True:
            time.sleep(1)
    """)
    async with _units(factory, "term") as sup:
        name = _unit("term", "polite")
        await sup.start(UnitSpec(name=name, argv=[sys.executable, "-c", code]))
        await wait_until(ready.exists, "the SIGTERM handler installed", timeout=DEADLINE)
        await sup.stop(name, timeout=DEADLINE)
        assert marker.read_text() == "SIGTERM"
        assert await sup.describe(name) is None


async def check_stop_kills_what_ignores_sigterm(factory: SupervisorFactory,
                                                scratch: Path) -> None:
    """`stop` ends every process of the unit, SIGKILL after `timeout` for those that
    ignore SIGTERM, and returns only once none is left."""
    pids = scratch / "stubborn-pids"
    script = (f'trap "" TERM; sleep 1000 & echo $! >> {pids}; sleep 1000 & '
              f"echo $! >> {pids}; echo $$ >> {pids}; wait; wait")
    async with _units(factory, "stubborn") as sup:
        name = _unit("stubborn", "unit")
        await sup.start(UnitSpec(name=name, argv=["sh", "-c", script]))
        members = await wait_until(lambda: _pids(pids, 3), "the unit's three processes",
                                   timeout=DEADLINE)
        assert all(alive(p) for p in members)
        with trio.fail_after(DEADLINE):
            await sup.stop(name, timeout=0.5)
        assert [p for p in members if alive(p)] == []
        assert await sup.describe(name) is None


async def check_stop_of_an_unknown_unit_is_a_no_op(factory: SupervisorFactory,
                                                   scratch: Path) -> None:
    async with _units(factory, "unknown") as sup:
        name = _unit("unknown", "never-started")
        await sup.stop(name, timeout=1)
        assert await sup.describe(name) is None
        assert await sup.list(name) == []


async def check_an_active_name_is_refused(factory: SupervisorFactory, scratch: Path) -> None:
    """Starting a name whose unit still runs is `AlreadyExists`, naming the unit, and
    leaves the running one alone."""
    async with _units(factory, "twice") as sup:
        name = _unit("twice", "single")
        info = await sup.start(_sleeper(name))
        refusal = await expect_raises_async(AlreadyExists, partial(sup.start, _sleeper(name)),
                                            "a second start of a running unit")
        assert name.removesuffix(".service") in str(refusal), refusal
        assert await sup.describe(name) == info


async def check_a_program_that_cannot_run_is_refused(factory: SupervisorFactory,
                                                     scratch: Path) -> None:
    """A program that cannot be executed is `FailedPrecondition` naming it, and leaves
    no unit behind."""
    async with _units(factory, "noexec") as sup:
        name = _unit("noexec", "missing")
        refusal = await expect_raises_async(
            FailedPrecondition,
            lambda: sup.start(UnitSpec(name=name, argv=["no-such-binary-kibotos"])),
            "a start of a program that does not exist")
        assert "no-such-binary-kibotos" in str(refusal), refusal
        assert await sup.describe(name) is None


async def check_bad_specs_are_refused(factory: SupervisorFactory, scratch: Path) -> None:
    """Names outside the `UnitSpec` rules and an empty argv are `InvalidArgument`."""
    async with _units(factory, "bad") as sup:
        for name in ("", ".hidden", "a/b", "x" * 201, "sp ace"):
            spec = UnitSpec(name=name, argv=["true"])
            await expect_raises_async(InvalidArgument, partial(sup.start, spec),
                                      f"a start of unit name {name!r}")
            await expect_raises_async(InvalidArgument, partial(sup.describe, name),
                                      f"a describe of unit name {name!r}")
        empty = UnitSpec(name=_unit("bad", "empty"), argv=[])
        await expect_raises_async(InvalidArgument, partial(sup.start, empty),
                                  "a start with an empty argv")


async def check_leftovers_go_when_the_name_returns(factory: SupervisorFactory,
                                                   scratch: Path) -> None:
    """What a dead unit left running is gone once its name is started again."""
    child = scratch / "leftover-child"
    async with _units(factory, "leftover") as sup:
        name = _unit("leftover", "parent")
        info = await sup.start(UnitSpec(
            name=name, argv=["sh", "-c", f"sleep 1000 & echo $! > {child}; wait"]))
        (pid,) = await wait_until(lambda: _pids(child, 1), "the child started",
                                  timeout=DEADLINE)
        assert info.main_pid is not None
        os.kill(info.main_pid, signal.SIGKILL)
        await _inactive(sup, name)
        again = await sup.start(_sleeper(name))
        assert again.active
        await wait_until(lambda: not alive(pid), "the dead unit's child gone",
                         timeout=DEADLINE)


SUPERVISOR_CHECKS: tuple[SupervisorCheck, ...] = (
    check_start_reports_the_process,
    check_start_applies_the_spec,
    check_a_new_supervisor_lists_and_adopts,
    check_units_outlive_their_starter,
    check_a_killed_main_process_ends_the_unit,
    check_a_failing_unit_is_inactive,
    check_stop_terminates_first,
    check_stop_kills_what_ignores_sigterm,
    check_stop_of_an_unknown_unit_is_a_no_op,
    check_an_active_name_is_refused,
    check_a_program_that_cannot_run_is_refused,
    check_bad_specs_are_refused,
    check_leftovers_go_when_the_name_returns,
)


async def check_supervisor(factory: SupervisorFactory, scratch: Path) -> None:
    """Every check of `SUPERVISOR_CHECKS`, in order, each in a fresh subdirectory of
    `scratch`; the first failure raises (an `AssertionError`, or the supervisor's own
    error where it raised one the contract does not allow)."""
    for check in SUPERVISOR_CHECKS:
        directory = scratch / check_id(check)
        directory.mkdir(parents=True)
        try:
            await check(factory, directory)
        except (AssertionError, KibotosError) as exc:
            raise AssertionError(f"{check.__name__}: {exc}") from exc
