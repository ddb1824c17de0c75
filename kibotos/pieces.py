"""Streaming a download or an upload into a blocking file writer, in whole pieces.

ctrl's artifact store (an upload) and the node's template cache (a fetch from ctrl)
both write a stream of chunks of any size through a worker thread into a writer that
hashes and writes sparsely.  They hand it whole pieces: one thread hop per piece, not
per chunk, and pieces aligned so that the zero runs the writer leaves as holes stay
aligned too.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable

import trio


async def write_in_pieces(chunks: AsyncIterable[bytes], write: Callable[[bytes], object],
                          piece: int) -> None:
    """Hand all of `chunks` to the blocking `write` (in a worker thread) in pieces of
    `piece` bytes, the last one shorter."""
    batch = bytearray()
    async for chunk in chunks:
        batch += chunk
        while len(batch) >= piece:
            await trio.to_thread.run_sync(write, bytes(batch[:piece]))
            del batch[:piece]
    if batch:
        await trio.to_thread.run_sync(write, bytes(batch))
