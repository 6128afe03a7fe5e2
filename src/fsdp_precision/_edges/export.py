"""Exports that load anywhere: the target library's layout, sharded safetensors, kept tensors in
their kept dtype, a record of what was kept; written one unit at a time, atomically.

From a wrapped model (collective: every rank gathers, rank 0 writes) or from a checkpoint
directory (local). Rank 0's peak memory is about one unit plus one output file.
"""

from __future__ import annotations

import importlib
import os
import shutil
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn as nn

from fsdp_precision._base.errors import CheckpointError, CheckpointWriteError
from fsdp_precision._edges.checkpoint.atomic import (
    prepare_target,
    recover,
    swap_into_place,
    write_json,
)
from fsdp_precision._edges.checkpoint.collective import from_rank0, rank_world
from fsdp_precision._edges.entries import Dtype, check_dtype
from fsdp_precision._edges.layouts import Layout, LayoutName, check_layout_name, layout_for
from fsdp_precision._edges.offline import checkpoint_stream
from fsdp_precision._edges.record import (
    EXPORT_RECORD,
    ExportRecord,
    kept_tensors,
    read_export_record,
)
from fsdp_precision._edges.shards import ShardWriter, check_shard_size, plan_shards
from fsdp_precision._edges.stream import WeightStream, full_weights

__all__ = ["export_safetensors"]


def export_safetensors(
    source: nn.Module | str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: Dtype = "stored",
    layout: LayoutName = "auto",
    max_shard_size: int | str = "5GB",
    step: int | None = None,
) -> Path:
    """Export ``source`` to ``out_dir`` in the layout its library loads; return the weights entry.

    ``source`` is a model, FSDP2-wrapped or not (collective: every rank calls it; rank 0
    writes), or the directory of a checkpoint written by :func:`save_checkpoint` (local: call it
    on one process).

    - ``layout``: ``"auto"`` picks the model's own: ``transformers`` (``config.json``,
      ``generation_config.json``, ``model.safetensors``; names as on the Hub, tied weights once),
      ``diffusers`` (``config.json``, ``diffusion_pytorch_model.safetensors``), ``peft``
      (``adapter_config.json``, ``adapter_model.safetensors``: the adapter alone), or ``plain``
      (``model.safetensors``).
    - ``dtype``: ``"stored"`` (default: every tensor as stored, fp32 master weights stay fp32);
      a torch dtype for the bulk (``torch.bfloat16``), kept tensors (routers, norms, anything the
      plan computed in another dtype) staying in theirs; ``"compute"``: each as training
      computed it.
    - ``max_shard_size``: files of at most this size (``"5GB"``, as Hugging Face), with
      ``<weights>.index.json`` when there are several.

    Written one unit at a time (each tensor's bytes as it is gathered) into a sibling temporary
    directory, the record
    (``fsdp_precision_export.json``: what was kept and why, the boundary casts, the files) last,
    then moved into place: a crash leaves the previous export or the new one, never a mix.
    ``out_dir`` must be new, empty, or an earlier export (files others put there are kept).
    Returns the path of ``model.safetensors`` (or its index; the layout's names).

    Raises ``ValueError`` for bad arguments before anything is read, and
    :class:`CheckpointWriteError` on every rank when the files cannot be written.
    """
    dtype = check_dtype(dtype)
    size = check_shard_size(max_shard_size)
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise ValueError(f"step={step!r} is not an int; pass the training step, or None")
    check_layout_name(layout)
    out = Path(out_dir).absolute()
    _require(out)
    if isinstance(source, nn.Module):
        chosen = layout_for(source, layout)  # a bad layout fails here, before any collective
        stream = full_weights(source, dtype=dtype, ranks="rank0", device="cpu", layout=layout)
        return _write(stream, chosen, out, dtype, size, step, collective=True)
    if not isinstance(source, (str, os.PathLike)):
        raise CheckpointError(
            f"export_safetensors source is a {type(source).__name__}; pass an nn.Module or the "
            "directory of a checkpoint written by save_checkpoint()"
        )
    stream, chosen = checkpoint_stream(recover(Path(source).absolute()), dtype, layout, size)
    return _write(stream, chosen, out, dtype, size, step, collective=False)


def _write(
    stream: WeightStream,
    layout: Layout,
    out: Path,
    dtype: Dtype,
    size: int,
    step: int | None,
    *,
    collective: bool,
) -> Path:
    """Every rank iterates ``stream``; rank 0 writes. The first error is raised on every rank
    after the stream ended (no rank leaves a gather the others are in). Not ``collective``:
    this process alone reads and writes."""
    rank = rank_world()[0] if collective else 0
    share = from_rank0 if collective else _same
    error: BaseException | None = None
    tmp: Path | None = None
    writer: ShardWriter | None = None
    entry = ""
    if rank == 0:
        try:
            tmp = prepare_target(out, EXPORT_RECORD, "export")
            plan = plan_shards(
                [(m.name, m.dtype, m.shape) for m in stream.metadata], layout.weights_name, size
            )
            entry = plan.entry
            declared = {m.name: (m.dtype, m.shape) for m in stream.metadata}
            writer = ShardWriter(tmp, plan, declared)
        except Exception as err:  # noqa: BLE001 - raised on every rank below
            error = _write_error(out, err)
    error = share(error)
    if error is not None:
        raise error
    for name, tensor in stream:  # tensor by tensor: each is freed once written
        if writer is not None and error is None:
            try:
                writer.add(name, tensor)
            except Exception as err:  # noqa: BLE001 - raised after the stream ended
                error = _write_error(out, err)
        del tensor
    if rank == 0 and error is None:
        assert tmp is not None and writer is not None
        try:
            files = writer.close()
            files += layout.save_config(tmp, _most_common(stream))
            record = ExportRecord(
                layout=layout.name,
                dtype=dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch."),
                bulk=stream.bulk,
                weights=entry,
                files=tuple(files),
                tensors=len(stream),
                nbytes=stream.nbytes,
                kept=kept_tensors(stream.metadata),
                casts=stream.casts,
                step=step,
            )
            _carry_foreign(out, tmp, files)
            write_json(tmp / EXPORT_RECORD, record.to_json())
            swap_into_place(tmp, out)
        except Exception as err:  # noqa: BLE001 - raised on every rank below
            error = _write_error(out, err)
    if rank == 0 and error is not None and tmp is not None and tmp.exists():
        shutil.rmtree(tmp, ignore_errors=True)  # our own partial export
    error = share(error)
    if error is not None:
        raise error
    return out / entry


def _require(out: Path) -> None:
    """The packages an export writes with, before anything is read or written."""
    for package in ("safetensors.torch", "huggingface_hub"):
        try:
            importlib.import_module(package)
        except ImportError as exc:
            raise CheckpointError(
                f"export_safetensors to '{out}' needs the {package.split('.')[0]} package, "
                "which is not installed; pip install 'fsdp-precision[hf]'"
            ) from exc


def _same(value: BaseException | None) -> BaseException | None:
    return value


def _most_common(stream: WeightStream) -> torch.dtype | None:
    """The dtype most of the exported elements are in (a config's ``dtype``)."""
    counts: Counter[torch.dtype] = Counter()
    for m in stream.metadata:
        if m.dtype.is_floating_point:
            counts[m.dtype] += _numel(m.shape)
    return counts.most_common(1)[0][0] if counts else None


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _carry_foreign(out: Path, tmp: Path, files: list[str]) -> None:
    """Copy into ``tmp`` what others put into an earlier export at ``out`` (a tokenizer): the
    swap then keeps it. ``CheckpointWriteError`` when this export would overwrite one of them."""
    if not out.is_dir():
        return
    try:
        ours = set(read_export_record(out).files) | {EXPORT_RECORD}
    except CheckpointError:
        ours = {EXPORT_RECORD}  # an empty directory (prepare_target refused anything else)
    for path in out.iterdir():
        if path.name in ours:
            continue
        if path.name in files:
            raise CheckpointWriteError(
                f"'{path}' was not written by the earlier export there, and this export would "
                "overwrite it; move it away or export into another directory"
            )
        copy: Callable[..., object] = shutil.copytree if path.is_dir() else shutil.copy2
        copy(path, tmp / path.name)


def _write_error(out: Path, cause: BaseException) -> CheckpointWriteError:
    if isinstance(cause, CheckpointWriteError):
        return cause
    error = CheckpointWriteError(
        f"cannot export to '{out}' ({cause!r}); the previous export there (if any) is "
        "unchanged: pass an out_dir that is (or can be made) a writable directory with free space"
    )
    error.__cause__ = cause
    return error
