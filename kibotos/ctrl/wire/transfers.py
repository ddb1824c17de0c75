"""Request and result shapes of the Transfer API: ``POST /v1/transfers/export`` and
``POST /v1/transfers/import`` (docs/storage.md, "Transfer").

As everywhere in the API, requests refuse unknown fields and check the Volume ID, the
pool ID, the digest and the labels before the command journal sees them.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from kibotos.ctrl.model.workspace_records import LABELS_SCHEMA, check_labels
from kibotos.ctrl.wire.base import Result, WriteRequest, _as_value_error
from kibotos.ctrl.wire.volumes import VolumeOut
from kibotos.protocol.ids import Digest, PoolId, VolumeId


class TransferExportIn(WriteRequest):
    volume_id: VolumeId


class TransferImportIn(WriteRequest):
    artifact_digest: Digest
    #: None: the one default pool of the nodes that can take it.
    pool_id: PoolId | None = None
    labels: dict[str, str] = Field(default_factory=dict, json_schema_extra=LABELS_SCHEMA)

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
