"""The requests of the ``files`` capability (docs/guest-protocol.md, "Files"), loaded
on the first one: nothing of it is on the way to the first hello.

`fileops` answers the metadata requests; `downloads`, `uploads` and `watches` stream,
each in a worker thread (`bridge`); `tarstream` packs and unpacks directory trees.
"""

from __future__ import annotations

from . import downloads, fileops, uploads, watches

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine
    from typing import Any

    from ..core import Agent
    from ..runtime.channel import Channel

REQUESTS: dict[str, Callable[[Agent, Channel, dict[str, Any]],
                             Coroutine[Any, Any, dict[str, Any]]]] = {
    "file_stat": fileops.stat_request, "file_mkdir": fileops.mkdir_request,
    "file_move": fileops.move_request, "file_remove": fileops.remove_request,
    "file_list": downloads.file_list, "file_read": downloads.file_read,
    "tar_read": downloads.tar_read, "file_write": uploads.file_write,
    "tar_write": uploads.tar_write, "transfer_commit": uploads.transfer_commit,
    "transfer_cancel": uploads.transfer_cancel, "file_watch": watches.file_watch,
}
