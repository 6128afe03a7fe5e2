"""Kept tensors back, exactly, after a library's own loader rounded them.

``from_pretrained(dir, dtype=torch.bfloat16)`` casts every tensor of an export to bf16 except
those the model declares kept: a router kept in fp32 by a rule comes back rounded. The export's
record names every kept tensor; :func:`restore_kept` reads those from the files (safetensors,
never code) and puts them into the loaded model in their kept dtype, with the boundary casts
training ran them with, so the model computes as it trained.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_precision._base.errors import CheckpointError, CheckpointReadError
from fsdp_precision._edges.entries import tensor_slots
from fsdp_precision._edges.record import (
    ExportRecord,
    KeptTensor,
    install_casts,
    read_export_record,
)

__all__ = ["restore_kept"]


def restore_kept(
    model: nn.Module, export_dir: str | os.PathLike[str], *, casts: bool = True
) -> list[str]:
    """Put the kept tensors of the export in ``export_dir`` into ``model``; return their names.

    Call it on the model its library loaded from the export (before wrapping it), e.g. after
    ``AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.bfloat16)``: each kept tensor
    (a router or norm trained in fp32) is read from the files and replaces the rounded one, in
    its kept dtype, bit for bit. ``casts``: also install the boundary casts training ran kept
    modules with (a router's input cast to fp32), so a forward computes as in training; modules
    that cast already are left alone.

    Everything is checked first: a kept tensor the model lacks, of another shape, missing from
    the files, or a model whose parameters are already sharded raises :class:`CheckpointError`
    with the model untouched.
    """
    record = read_export_record(export_dir)
    root = Path(export_dir)
    slots = tensor_slots(model)
    restorable = [k for k in record.kept if k.param is not None]
    missing = sorted(str(k.param) for k in restorable if k.param not in slots)
    if missing:
        raise CheckpointError(
            f"the model has no tensor named {missing[:3]} (of {len(missing)} kept in "
            f"'{export_dir}'): load the export with the model class it was written from"
        )
    sharded = [str(k.param) for k in restorable if isinstance(slots[str(k.param)][2], DTensor)]
    if sharded:
        raise CheckpointError(
            f"{sharded[0]!r} is already sharded (a DTensor); call restore_kept on the model "
            "its library loaded, before fully_shard"
        )
    values = _read(root, record, restorable)
    for kept in restorable:
        current = slots[str(kept.param)][2]
        if tuple(values[kept.name].shape) != tuple(current.shape):
            raise CheckpointError(
                f"kept tensor {kept.name!r} of '{export_dir}' has shape "
                f"{tuple(values[kept.name].shape)}, the model's {kept.param!r} "
                f"{tuple(current.shape)}: load the export with the model it was written from"
            )
    with torch.no_grad():
        for kept in restorable:
            module, attr, current = slots[str(kept.param)]
            # A copy in fresh memory: no reference into the file's buffer, and aligned as the
            # CPU kernels expect (a tensor read at an odd file offset can compute differently).
            value = values[kept.name].to(current.device, copy=True)
            if isinstance(current, nn.Parameter):
                current.data = value  # the same Parameter: tied aliases and references follow
            else:
                module._buffers[attr] = value
    if casts:
        install_casts(model, record.casts)
    return [str(k.param) for k in restorable]


def _read(root: Path, record: ExportRecord, kept: list[KeptTensor]) -> dict[str, torch.Tensor]:
    """The kept tensors from the export's safetensors files (the index says which file)."""
    from safetensors import safe_open  # lazy: an optional dependency

    if record.weights.endswith(".index.json"):
        try:
            weight_map = json.loads((root / record.weights).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointReadError(
                f"cannot read the index '{root / record.weights}' ({err!r}); export again"
            ) from err
    else:
        weight_map = {k.name: record.weights for k in kept}
    by_file: dict[str, list[str]] = {}
    for k in kept:
        file = weight_map.get(k.name)
        if not isinstance(file, str) or file not in record.files:
            raise CheckpointReadError(
                f"kept tensor {k.name!r} is in no file of the export '{root}'; export again"
            )
        by_file.setdefault(file, []).append(k.name)
    values: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        try:
            with safe_open(str(root / file), framework="pt") as f:
                for name in names:
                    values[name] = f.get_tensor(name)
        except Exception as err:  # noqa: BLE001 - safetensors raises its own types
            raise CheckpointReadError(
                f"cannot read kept tensors {names[:3]} from '{root / file}' ({err!r}); the "
                "export is damaged: export again"
            ) from err
    for k in kept:
        if values[k.name].dtype != k.dtype:
            raise CheckpointReadError(
                f"kept tensor {k.name!r} is {values[k.name].dtype} in '{root}', its record says "
                f"{k.dtype}: the files and the record are of different exports; export again"
            )
    return values
