"""``file_watch`` against the real agent process and real inotify (paths under its
``--root``): the five kinds of change, names relative to the watched directory,
recursion into directories created later, the end when the directory goes, a cancel
that leaves no watch behind, and an overflow that is reported rather than buffered."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import trio
from guest_harness import TIMEOUT, AgentProcess

from kibotos.core.errors import FailedPrecondition, NotFound
from kibotos.guest import GuestChannel
from kibotos.guest.files import Download


async def next_events(down: Download, want: int, pending: bytearray) -> list[dict[str, Any]]:
    """At least `want` events (whole lines), reading the stream as needed."""
    events: list[dict[str, Any]] = []
    with trio.fail_after(TIMEOUT):
        while len(events) < want:
            while b"\n" in pending:
                line, _, rest = bytes(pending).partition(b"\n")
                pending[:] = rest
                events.append(json.loads(line))
            if len(events) >= want:
                break
            chunk = await down.stream.receive_some()
            assert chunk, f"the watch ended early after {events}"
            pending += chunk
    return events


def watch_fds(agent: AgentProcess) -> int:
    """The agent's inotify descriptors."""
    fd_dir = Path(f"/proc/{agent.proc.pid}/fd")
    return sum(1 for fd in fd_dir.iterdir()
               if os.readlink(fd) == "anon_inode:inotify")


async def test_changes_are_streamed_and_recursion_follows_new_directories(
        guest: GuestChannel, agent: AgentProcess) -> None:
    top = agent.root / "srv/w"
    (top / "old").mkdir(parents=True)
    assert "files.watch" in (guest.hello.capabilities if guest.hello else ())
    async with await guest.files.open_watch("/srv/w", recursive=True) as down:
        assert (down.entry.path, down.entry.type) == ("/srv/w", "directory")
        pending = bytearray()
        (top / "a.txt").write_bytes(b"x")             # create (+ write)
        (top / "old/b.txt").write_bytes(b"")           # below: a directory that existed
        os.chmod(top / "a.txt", 0o600)                 # chmod
        os.rename(top / "a.txt", top / "c.txt")        # rename (from) + create (to)
        (top / "new").mkdir()                          # a directory made after the start
        events = await next_events(down, 7, pending)
        (top / "new/d.txt").write_bytes(b"d")          # ...is watched too
        os.unlink(top / "c.txt")                       # remove
        events += await next_events(down, 3, pending)
    assert events == [
        {"name": "a.txt", "type": "create"}, {"name": "a.txt", "type": "write"},
        {"name": "old/b.txt", "type": "create"}, {"name": "a.txt", "type": "chmod"},
        {"name": "a.txt", "type": "rename"}, {"name": "c.txt", "type": "create"},
        {"name": "new", "type": "create"}, {"name": "new/d.txt", "type": "create"},
        {"name": "new/d.txt", "type": "write"}, {"name": "c.txt", "type": "remove"}]
    # Leaving the download cancelled the watch in the guest: its inotify is closed.
    await guest.ping()
    assert watch_fds(agent) == 0


async def test_a_flat_watch_ignores_subdirectories_and_ends_with_its_directory(
        guest: GuestChannel, agent: AgentProcess) -> None:
    top = agent.root / "srv/flat"
    (top / "sub").mkdir(parents=True)
    async with await guest.files.open_watch("/srv/flat") as down:
        (top / "sub/inner").write_bytes(b"")           # not seen: not recursive
        (top / "sub/inner").unlink()
        os.rmdir(top / "sub")                          # seen: an entry of /srv/flat
        os.rmdir(top)                                  # the watched directory goes
        with trio.fail_after(TIMEOUT):
            data = await down.stream.read_all()
            done = await down.result()
    assert [json.loads(line) for line in data.splitlines()] == [
        {"name": "sub", "type": "remove"}]
    assert (done.body["events"], done.bytes) == (1, len(data))


async def test_bad_paths_are_refused_before_any_watch(guest: GuestChannel,
                                                      agent: AgentProcess) -> None:
    (agent.root / "srv").mkdir()
    (agent.root / "srv/file").write_bytes(b"")
    with pytest.raises(NotFound):
        await guest.files.open_watch("/srv/missing")
    with pytest.raises(FailedPrecondition, match="not a directory"):
        await guest.files.open_watch("/srv/file")
    assert watch_fds(agent) == 0


async def test_what_a_new_directory_holds_before_its_watch_is_reported(
        guest: GuestChannel, agent: AgentProcess) -> None:
    top = agent.root / "srv/fast"
    top.mkdir(parents=True)
    async with await guest.files.open_watch("/srv/fast", recursive=True) as down:
        # Made and filled at once, the way a process in the guest does it: the files
        # may exist before the agent sets the new directories' watches.
        (top / "new/d").mkdir(parents=True)
        (top / "new/d/full").write_bytes(b"content")
        pending = bytearray()
        events = await next_events(down, 1, pending)
        while {"name": "new/d/full", "type": "write"} not in events:
            events += await next_events(down, 1, pending)
    # However the race went, each was seen created, once, and the file written.
    for name in ("new", "new/d", "new/d/full"):
        assert events.count({"name": name, "type": "create"}) == 1, events


async def test_files_made_while_a_new_directory_is_listed_are_created_once(
        guest: GuestChannel, agent: AgentProcess) -> None:
    """The race the listing of a new directory opens: files made after its watch is
    set but before the listing reaches them are both listed and reported by the
    kernel; the stream says create once for each."""
    top = agent.root / "srv/race"
    top.mkdir(parents=True)
    names = [f"many/f{i:03}" for i in range(200)]
    async with await guest.files.open_watch("/srv/race", recursive=True) as down:
        (top / "many").mkdir()
        for name in names:
            (top / name).write_bytes(b"")
        (top / "done").write_bytes(b"")  # after every one of them, in the top
        pending = bytearray()
        events = await next_events(down, 1, pending)
        while {"name": "done", "type": "create"} not in events:
            events += await next_events(down, 1, pending)
        (top / "many/f000").unlink()  # a name listed, then removed and made again
        (top / "many/f000").write_bytes(b"")
        events += await next_events(down, 2, pending)
    creates = [e["name"] for e in events if e["type"] == "create"]
    assert sorted(creates) == sorted(["many", "done", *names, "many/f000"])
    assert events[-2:] == [{"name": "many/f000", "type": "remove"},
                           {"name": "many/f000", "type": "create"}]


@pytest.fixture
def queue_limit() -> int:
    """The kernel's inotify queue length (``fs.inotify.max_queued_events``)."""
    return int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())


async def test_an_unread_watch_reports_an_overflow_instead_of_buffering(
        guest: GuestChannel, agent: AgentProcess, queue_limit: int) -> None:
    top = agent.root / "srv/busy"
    top.mkdir(parents=True)
    limit = queue_limit
    made = 3 * limit
    # A small window and nobody reading: the guest stops reading inotify after one
    # batch, so the kernel's queue (not the agent) takes the events until it overflows.
    async with await guest.files.open_watch("/srv/busy", window=4096) as down:
        targets = [top / "f0", top / "f1"]
        for target in targets:
            target.write_bytes(b"")
        for i in range(made):  # alternating: the kernel merges repeated events
            os.utime(targets[i % 2], ns=(i, i))        # chmod events (IN_ATTRIB)
        pending = bytearray()
        seen: list[dict[str, Any]] = []
        while {"type": "overflow"} not in seen:
            seen += await next_events(down, 1, pending)
    # At most the kernel's queue and the one batch the agent had read came through.
    assert len(seen) <= limit + 64 * 1024 // 16 + 4 < made
