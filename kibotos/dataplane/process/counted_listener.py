"""The data plane's listener, counting the connections it accepted until each ends.

A generation that a newer one replaced stops accepting and exits once its connections
ended (`kibotos.dataplane.process.listen_handover`).  The exec, port and file sessions it
registers are not all of them: a connection accepted a moment before is still in its
handshake or reading its request head, and would be cut if the process exited then.
Counting at accept, in the one method that sees every accepted stream
(`DataplaneListener._handle_connection`), covers them too.
"""

from __future__ import annotations

from typing import Any

import trio

from kibotos.dataplane.endpoints.http1 import DataplaneListener


class CountedListener(DataplaneListener):
    """`DataplaneListener` with `open_streams` and `wait_no_streams`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.open_streams = 0
        self._no_streams = trio.Event()
        self._no_streams.set()

    async def wait_no_streams(self) -> None:
        """Until every accepted connection ended, also one still in its handshake."""
        await self._no_streams.wait()

    async def _handle_connection(self, stream: trio.abc.Stream) -> None:
        self.open_streams += 1
        self._no_streams = trio.Event()
        try:
            await super()._handle_connection(stream)
        finally:
            self.open_streams -= 1
            if not self.open_streams:
                self._no_streams.set()
