"""A process the node runs by generation (the data plane, the egress process): its unit
names, its generation counter, and finding, starting and ending its units.

Both run the node's own executable in units of their own through the node's supervisor
plugin, so they outlive a node restart (spec: "Data-plane processes", "Egress
processes"): ``<prefix><scope>-<generation>``, the scope naming this node's processes
on the host (`kibotos.node.network.names.node_scope`, from the socket directory), the
generation growing by one at every start and persisted in
``<storage.root>/state/<counter>`` *before* the unit starts, so a node that dies in
between never reuses a number.  What differs between the two (what they are handed,
how they are adopted and replaced) stays with their supervisors; this is the part that
is the same.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from kibotos.backends import Supervisor, UnitInfo
from kibotos.core import atomicfile
from kibotos.core.errors import KibotosError, Unavailable
from kibotos.core.logs import EventLogger

log = EventLogger()


@dataclass(frozen=True)
class ProcessUnits:
    """The units of one kind of node-run process."""

    #: Unit names start with it: ``kibotos-dataplane-``.
    prefix: str
    #: The generation counter's file name in the state directory.
    counter: str
    #: How log lines and errors name the process: ``data-plane``.
    what: str

    def unit_name(self, scope: str, generation: int) -> str:
        return f"{self.prefix}{scope}-{generation}"

    def generation_of(self, name: str, scope: str) -> int | None:
        """The generation a unit name of `scope` carries (``.service`` or not); None
        for another kind's or another scope's unit."""
        head = f"{self.prefix}{scope}-"
        tail = name.removeprefix(head).removesuffix(".service")
        return int(tail) if name.startswith(head) and tail.isdigit() else None

    def read_generation(self, path: Path) -> int:
        """The last persisted generation (0 before the first); a damaged file is logged
        and read as 0: the units still running tell the real floor."""
        try:
            text = path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            return 0
        except (OSError, UnicodeDecodeError) as exc:
            log.error(f"{self.what} generation file unreadable", path=path, error=str(exc))
            return 0
        if not text.isdigit():
            log.error(f"{self.what} generation file is damaged", path=path,
                      content=text[:40])
            return 0
        return int(text)

    async def next_generation(self, state_dir: Path, running: Iterable[int] = ()) -> int:
        """The number of the next start, above the counter and every generation still
        `running`, persisted before this returns."""
        path = state_dir / self.counter
        floor = await trio.to_thread.run_sync(self.read_generation, path)
        number = max([floor, *running]) + 1

        def persist() -> None:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            atomicfile.write_bytes(path, f"{number}\n".encode())

        await trio.to_thread.run_sync(persist)
        return number

    async def units(self, supervisor: Supervisor, scope: str) -> list[UnitInfo]:
        """The scope's units of this kind (running or not), oldest generation first."""
        found = await supervisor.list(f"{self.prefix}{scope}-")
        return sorted(found, key=lambda u: self.generation_of(u.name, scope) or 0)

    async def stop_all(self, supervisor: Supervisor, scope: str, *, timeout: float
                       ) -> list[str]:
        """End every unit of this kind of the scope; the ones that were running."""
        stopped = []
        for info in await self.units(supervisor, scope):
            if info.active:
                stopped.append(info.name)
            await supervisor.stop(info.name, timeout=timeout)
        return stopped

    async def wait_serving(self, supervisor: Supervisor, name: str, generation: int,
                           status: Callable[[], Awaitable[dict[str, Any]]], *,
                           timeout: float) -> bool:
        """Until a just started unit answers `status` as `generation` (True), at most
        `timeout` seconds (False); a unit that exits meanwhile is forgotten and
        `Unavailable` at once."""
        with trio.move_on_after(timeout):
            while True:
                try:
                    if (await status()).get("generation") == generation:
                        return True
                except KibotosError:
                    pass
                current = await supervisor.describe(name)
                if current is None or not current.active:
                    await supervisor.stop(name, timeout=1.0)  # forget the dead unit
                    raise Unavailable(f"{self.what} unit {name} exited at once (see the "
                                      "unit's log)")
                await trio.sleep(0.05)
        return False
