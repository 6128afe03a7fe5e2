"""Checkpoints of FSDP2 models with exact per-parameter dtypes, on ``torch.distributed.checkpoint``.

>>> from fsdp_precision import checkpoint
>>> checkpoint.save_checkpoint("ckpt", model, optimizer, step=100)  # doctest: +SKIP
>>> step = checkpoint.load_checkpoint("ckpt", model, optimizer)      # doctest: +SKIP

``"sharded"`` checkpoints (every rank writes its shards; loadable at another world size or mesh)
and ``"full"`` ones (consolidated on rank 0; exportable to safetensors for ``from_pretrained``).
Saves are atomic: a crash mid-save leaves the previous checkpoint loadable. Every tensor keeps
its own dtype. Every error is a :class:`CheckpointError` naming the path and the fix. See
``docs/checkpoints.md``.
"""

from __future__ import annotations

from fsdp_precision._base.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReadError,
    CheckpointWriteError,
    StateDictMismatchError,
)
from fsdp_precision._train.checkpoint import (
    METADATA_FILE,
    StateDictType,
    export_safetensors,
    load_checkpoint,
    load_model_state_dict,
    model_state_dict,
    read_checkpoint_metadata,
    save_checkpoint,
)

__all__ = [
    "METADATA_FILE",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointReadError",
    "CheckpointWriteError",
    "StateDictMismatchError",
    "StateDictType",
    "export_safetensors",
    "load_checkpoint",
    "load_model_state_dict",
    "model_state_dict",
    "read_checkpoint_metadata",
    "save_checkpoint",
]
