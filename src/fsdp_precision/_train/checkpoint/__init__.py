"""Checkpoints of FSDP2 models with exact per-parameter dtypes, on ``torch.distributed.checkpoint``.

One module per job:

- ``state``: :func:`model_state_dict` / :func:`load_model_state_dict`, in-memory state dicts
  ("full": consolidated CPU tensors on rank 0; "sharded": DTensors on every rank), validated
  before anything is loaded.
- ``atomic``: the on-disk protocol that makes a save atomic (a sibling temporary directory, a
  completion marker written last, two renames) and recovers what an interrupted save left.
- ``metadata``: the checkpoint's JSON marker and DCP's tensor metadata
  (:func:`read_checkpoint_metadata`).
- ``save_load``: :func:`save_checkpoint` / :func:`load_checkpoint`, model (+ optimizer)
  checkpoints in DCP format, loadable at another world size or mesh.
- ``export``: :func:`export_safetensors`, ``model.safetensors`` (+ ``config.json``) for Hugging
  Face ``from_pretrained``.
- ``collective``: what every rank must agree on (rank 0's value, the first rank's error).

Every tensor keeps its own dtype: a unit that stores some parameters in fp32 and others in bf16
saves and loads each in its own dtype. Every error is a :class:`CheckpointError` naming the path
and the fix. See ``docs/checkpoints.md``.
"""

from __future__ import annotations

from fsdp_precision._train.checkpoint.atomic import METADATA_FILE
from fsdp_precision._train.checkpoint.export import export_safetensors
from fsdp_precision._train.checkpoint.metadata import read_checkpoint_metadata
from fsdp_precision._train.checkpoint.save_load import load_checkpoint, save_checkpoint
from fsdp_precision._train.checkpoint.state import (
    StateDictType,
    load_model_state_dict,
    model_state_dict,
)

__all__ = [
    "METADATA_FILE",
    "StateDictType",
    "export_safetensors",
    "load_checkpoint",
    "load_model_state_dict",
    "model_state_dict",
    "read_checkpoint_metadata",
    "save_checkpoint",
]
