"""Request and result shapes of the Transfer API: ``POST /v1/transfers/export`` and
``POST /v1/transfers/import`` (docs/storage.md, "Transfer").

As everywhere in the API, requests refuse unknown fields and check the Volume ID, the
pool ID, the digest and the labels before the command journal sees them.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from kibotos import ids
from kibotos.ctrl.model.workspace_records import check_labels
from kibotos.ctrl.wire.base import Result, WriteRequest, _as_value_error
from kibotos.ctrl.wire.volumes import VolumeOut, _pool, _volume_id


class TransferExportIn(WriteRequest):
    volume_id: str

    _vid = field_validator("volume_id")(lambda v: _volume_id(v))


class TransferImportIn(WriteRequest):
    artifact_digest: str
    #: None: the one default pool of the nodes that can take it.
    pool_id: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)

    _pool_id = field_validator("pool_id")(lambda v: _pool(v))

    @field_validator("artifact_digest")
    @classmethod
    def _digest(cls, v: str) -> str:
        checked: str = _as_value_error(ids.check_digest, v)
        return checked

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        checked: dict[str, str] = _as_value_error(check_labels, v)
        return checked


class TransferExportOut(Result):
    volume_id: str
    pool_id: str
    node_id: str
    epoch: int
    artifact_digest: str
    size: int
    capacity_bytes: int


class TransferImportOut(Result):
    volume: VolumeOut
    artifact_digest: str
    node_id: str
    source_volume_id: str
