"""Safetensors for Hugging Face ``from_pretrained``, from a wrapped model or a checkpoint."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from fsdp_precision._base.errors import CheckpointError, CheckpointReadError, CheckpointWriteError
from fsdp_precision._train.checkpoint.atomic import recover
from fsdp_precision._train.checkpoint.collective import (
    CheckpointException,
    describe,
    from_rank0,
    rank_world,
    single_process,
)
from fsdp_precision._train.checkpoint.metadata import MODEL, read_metadata, saved_tensors
from fsdp_precision._train.checkpoint.state import model_state_dict

__all__ = ["export_safetensors"]

_SaveFile = Callable[..., None]


def export_safetensors(
    source: nn.Module | str | os.PathLike[str], out_dir: str | os.PathLike[str]
) -> Path:
    """Write ``model.safetensors`` (and ``config.json``) into ``out_dir`` for ``from_pretrained``.

    ``source`` is either

    - an FSDP2-wrapped model: collective (every rank calls it); the state is consolidated on
      rank 0, which writes the files; the model's ``config.save_pretrained`` adds ``config.json``;
    - a checkpoint directory written by :func:`save_checkpoint` (either type): local, call it on
      one process; the model tensors are read from it, its ``config.json`` (if any) is copied.

    Tensors keep their dtypes. Each file is written to a temporary name and renamed into place.
    Returns the path of ``model.safetensors``. Needs the ``safetensors`` package
    (``pip install 'fsdp-precision[hf]'``). Raises :class:`CheckpointWriteError` (on every rank)
    when ``out_dir`` cannot be written, and for a checkpoint directory
    :class:`CheckpointNotFoundError` or :class:`CheckpointReadError` as :func:`load_checkpoint`.
    """
    if not isinstance(source, (nn.Module, str, os.PathLike)):
        raise CheckpointError(
            f"export_safetensors source is a {type(source).__name__}; pass an nn.Module or the "
            "directory of a checkpoint written by save_checkpoint()"
        )
    out = Path(out_dir)
    try:
        from safetensors.torch import save_file  # lazy: an optional dependency
    except ImportError as exc:
        raise CheckpointError(
            f"export_safetensors to '{out}' needs the safetensors package, which is not "
            "installed; pip install 'fsdp-precision[hf]' (or pip install safetensors)"
        ) from exc

    weights = out / "model.safetensors"
    if isinstance(source, nn.Module):
        state = model_state_dict(source, "full")
        error: CheckpointWriteError | None = None
        if rank_world()[0] == 0:
            config = getattr(source, "config", None)
            error = _write(save_file, state, weights, lambda: _save_config(config, out))
        error = from_rank0(error)  # also the barrier: no rank returns before the files exist
        if error is not None:
            raise error
        return weights

    path = recover(Path(source).absolute())
    read_metadata(path)
    template = {k: torch.empty(s, dtype=d) for k, (s, d) in saved_tensors(path, MODEL).items()}
    try:
        with single_process():
            dcp_load({MODEL: template}, checkpoint_id=path, no_dist=True)
    except (OSError, CheckpointException) as err:
        raise CheckpointReadError(
            f"cannot read the model tensors of checkpoint '{path}' ({describe(err)}); a file of "
            "the checkpoint is missing or damaged: export an earlier checkpoint, or the model"
        ) from err
    copy_config = (path / "config.json").is_file()
    error = _write(
        save_file,
        template,
        weights,
        lambda: copy_config and shutil.copyfile(path / "config.json", out / "config.json"),
    )
    if error is not None:
        raise error
    return weights


def _save_config(config: Any, out: Path) -> None:
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(out)


def _write(
    save_file: _SaveFile, state: Mapping[str, Any], weights: Path, config: Callable[[], object]
) -> CheckpointWriteError | None:
    """Write the weights (to a temporary name, then renamed) and the config; the error, if any."""
    try:
        weights.parent.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
        partial = weights.with_name(f".{weights.name}.partial")
        save_file(tensors, str(partial), metadata={"format": "pt"})
        os.replace(partial, weights)
        config()
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error type on I/O
        error = CheckpointWriteError(
            f"cannot write '{weights}' ({err!r}); pass an out_dir that is (or can be made) a "
            "writable directory with free space"
        )
        error.__cause__ = err
        return error
    return None
