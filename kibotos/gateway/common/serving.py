"""Running a gateway process: hypercorn's settings for an ASGI listener, the signals
that stop it, and the address files a gateway writes once it listens (a listener may
be given port 0; tests and the dev cluster read the bound address from the file)."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import trio
from hypercorn.config import Config as HypercornConfig

from kibotos.core import atomicfile

log = logging.getLogger("kibotos.gateway")


def hypercorn_config(listen: str) -> HypercornConfig:
    hc = HypercornConfig()
    hc.bind = [listen]
    hc.accesslog = None
    hc.graceful_timeout = 5.0
    # Idle keep-alive connections outlive the clients' (httpx: 5 s; SDKs similar), so
    # a client never sends on a connection the server is closing (as ctrl's,
    # `kibotos.ctrl.serve.KEEP_ALIVE_TIMEOUT`).
    hc.keep_alive_timeout = 75.0
    return hc


async def stop_on_signals(cancel: trio.CancelScope) -> None:
    """Cancel `cancel` at the first SIGTERM or SIGINT."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
        async for signum in received:
            log.info("gateway: %s received, stopping", signal.Signals(signum).name)
            cancel.cancel()
            return


def write_address(path: Path, address: str) -> None:
    """``host:port`` and a newline, atomically."""
    atomicfile.write_bytes(path, (address + "\n").encode())
