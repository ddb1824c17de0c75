"""HTTP API of Transfers, Volumes through ctrl's artifact store (docs/storage.md,
"Transfer"): ``POST /v1/transfers/export`` and ``POST /v1/transfers/import``.

The handlers parse the request and hand it to `TransferService`
(`kibotos.ctrl.live.transfer_service`, where what an export and an import do is
described); both answer once the node did the work, which for a large Volume takes
minutes.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from kibotos.ctrl.api.auth import Caller
from kibotos.ctrl.api.routing import Route, identity_of, read_body
from kibotos.ctrl.live.transfer_service import TransferService
from kibotos.ctrl.wire.transfers import (
    TransferExportIn,
    TransferExportOut,
    TransferImportIn,
    TransferImportOut,
)


def routes(transfers: TransferService) -> list[Route]:
    async def export(request: Request, caller: Caller | None) -> dict[str, Any]:
        body = await read_body(request, TransferExportIn)
        return await transfers.export_volume(body, identity_of(caller))

    async def import_(request: Request, caller: Caller | None) -> dict[str, Any]:
        body = await read_body(request, TransferImportIn)
        return await transfers.import_volume(body, identity_of(caller))

    return [
        Route("POST", "/v1/transfers/export", export,
              "Export a Volume as a Transfer archive into the artifact store (answers "
              "when the archive is stored)", body=TransferExportIn, result=TransferExportOut),
        Route("POST", "/v1/transfers/import", import_,
              "Import a Transfer archive from the artifact store as a new Volume "
              "(answers when it is AVAILABLE)", body=TransferImportIn, result=TransferImportOut),
    ]
