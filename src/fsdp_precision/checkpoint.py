"""Checkpoints of FSDP2 models with exact per-parameter dtypes, on ``torch.distributed.checkpoint``.

>>> from fsdp_precision import checkpoint
>>> checkpoint.save_checkpoint("ckpt", model, optimizer, step=100)  # doctest: +SKIP
>>> step = checkpoint.load_checkpoint("ckpt", model, optimizer)      # doctest: +SKIP

``"sharded"`` checkpoints (every rank writes its shards; loadable at another world size or mesh)
and ``"full"`` ones (consolidated on rank 0). Exports for the model's own library
(:func:`export_safetensors`: the transformers, Diffusers or PEFT layout, sharded, kept tensors in
their kept dtype, one unit in memory at a time) and the kept tensors back after its loader
rounded them (:func:`restore_kept`).
Saves are atomic: a crash mid-save leaves the previous checkpoint loadable. Every tensor keeps
its own dtype. A training run's checkpoints: :func:`save_step` (one per step, the last few
kept) and :func:`resume_from_latest` (after a restart, e.g. ``torchrun --max-restarts``).
Loading never runs what a file holds, and verifies the checksums the save recorded;
:func:`check_checkpoint` makes the same checks on a checkpoint a framework will load (accelerate's
``load_state``, torchtitan's checkpointer). Every error is a :class:`CheckpointError` naming the
path and the fix. See ``docs/checkpoints.md``.
"""

from __future__ import annotations

from fsdp_precision._base.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReadError,
    CheckpointWriteError,
    StateDictMismatchError,
    UnsafeCheckpointError,
)
from fsdp_precision._edges.checkpoint.atomic import METADATA_FILE
from fsdp_precision._edges.checkpoint.foreign import check_checkpoint
from fsdp_precision._edges.checkpoint.metadata import read_checkpoint_metadata
from fsdp_precision._edges.checkpoint.rotate import (
    latest_checkpoint,
    resume_from_latest,
    save_step,
)
from fsdp_precision._edges.checkpoint.save_load import load_checkpoint, save_checkpoint
from fsdp_precision._edges.checkpoint.state import (
    StateDictType,
    load_model_state_dict,
    model_state_dict,
)
from fsdp_precision._edges.export import export_safetensors
from fsdp_precision._edges.record import (
    EXPORT_RECORD,
    ExportRecord,
    KeptTensor,
    RecordedCast,
    read_export_record,
)
from fsdp_precision._edges.restore import restore_kept
from fsdp_precision._edges.safe_globals import SAFE_GLOBALS

__all__ = [
    "EXPORT_RECORD",
    "METADATA_FILE",
    "SAFE_GLOBALS",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointReadError",
    "CheckpointWriteError",
    "ExportRecord",
    "KeptTensor",
    "RecordedCast",
    "StateDictMismatchError",
    "StateDictType",
    "UnsafeCheckpointError",
    "check_checkpoint",
    "export_safetensors",
    "latest_checkpoint",
    "load_checkpoint",
    "load_model_state_dict",
    "model_state_dict",
    "read_checkpoint_metadata",
    "read_export_record",
    "restore_kept",
    "resume_from_latest",
    "save_checkpoint",
    "save_step",
]
