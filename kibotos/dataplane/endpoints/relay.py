"""What every relay between a client's WebSocket and the guest shares (exec, ports).

A relay runs its directions in one cancel scope and ends the first way it can: the
process exits, the client goes, the guest channel fails, the data plane stops.  The
first outcome is the one reported (and closes the WebSocket its way); later ones are
consequences of the first and are dropped.
"""

from __future__ import annotations

import json
from typing import Any

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from kibotos.core.errors import InvalidArgument, KibotosError


class Relay:
    """The ending of one relay over `ws`."""

    def __init__(self, ws: WebSocketConnection) -> None:
        self.ws = ws
        self._scope: trio.CancelScope | None = None
        self._outcome: str | None = None
        self._error: KibotosError | None = None

    def _finish(self, outcome: str, error: KibotosError | None = None) -> None:
        """The first outcome wins; it ends the relay."""
        if self._outcome is None:
            self._outcome = outcome
            self._error = error
        if self._scope is not None:
            self._scope.cancel()

    async def _client_message(self) -> str | bytes | None:
        """The client's next frame; None once it is gone (the relay then ends so)."""
        try:
            return await self.ws.get_message()
        except ConnectionClosed:
            self._finish("client_gone")
            return None


def control_message(text: str, limit: int, what: str) -> Any:
    """A client's text frame: a JSON control message of at most `limit` characters
    (`what` names the relay in the error)."""
    if len(text) > limit:
        raise InvalidArgument(f"{what}: control frame too long")
    try:
        return json.loads(text)
    except ValueError:
        raise InvalidArgument(f"{what}: a text frame must be a JSON control message") from None
