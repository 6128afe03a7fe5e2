"""SGLang's distributed weight updates, with the kept dtypes in their metadata.

SGLang's ``Engine.update_weights_from_distributed(names, dtypes, shapes, group_name, flush_cache,
load_format)`` (``sglang/srt/model_executor/model_runner_components/weight_updater.py``) allocates
each listed tensor in the dtype named (``getattr(torch, dtype)``), receives it by broadcast from
rank 0 of the update group, and hands it to ``model.load_weights``. With
``load_format="flattened_bucket"`` it lays one ``uint8`` buffer out from the names, dtypes and
shapes alone (``weight_sync/tensor_bucket.py: FlattenedTensorBucket.empty``), tensors back to
back in the order listed, and refuses a tensor whose byte offset is not a multiple of its element
size ("Unaligned received tensor"). :func:`distributed_updates` lists each bucket widest elements
first, so every offset is aligned without padding; :func:`update_payloads` packs what the trainer
broadcasts. Pure: SGLang is never imported.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._engines.transfer import BUCKET_BYTES

__all__ = ["DistributedUpdate", "FlatTensor", "distributed_updates", "update_payloads"]


@dataclass(frozen=True)
class FlatTensor:
    """One tensor in an SGLang flattened bucket: the fields of SGLang's
    ``FlattenedTensorMetadata`` (``weight_sync/tensor_bucket.py``), offsets and ``numel`` in
    bytes (the bucket is a ``uint8`` tensor)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclass(frozen=True)
class DistributedUpdate:
    """One call of SGLang's ``Engine.update_weights_from_distributed``.

    Attributes:
        names: The tensors, in the order SGLang receives them.
        dtypes: Their dtypes as SGLang names them (``"bfloat16"``, ``"float32"``).
        shapes: Their full shapes.
        load_format: ``"flattened_bucket"`` (one broadcast of :attr:`flat`'s bytes) or ``None``
            (one broadcast per tensor, in order).
        flat: The bucket as SGLang lays it out from names, dtypes and shapes
            (``FlattenedTensorBucket.empty``); empty without ``"flattened_bucket"``.
    """

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    load_format: Literal["flattened_bucket"] | None
    flat: tuple[FlatTensor, ...] = ()

    def kwargs(
        self, group_name: str = "weight_update_group", flush_cache: bool = True
    ) -> dict[str, Any]:
        """Keyword arguments of ``engine.update_weights_from_distributed`` (JSON-ready: the
        body of the server's ``/update_weights_from_distributed``)."""
        return {
            "names": list(self.names),
            "dtypes": list(self.dtypes),
            "shapes": [list(s) for s in self.shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
            "load_format": self.load_format,
        }


def _flat(metas: Sequence[Any]) -> tuple[FlatTensor, ...]:
    out, offset = [], 0
    for m in metas:
        size = m.dtype.itemsize * _numel(m.shape)
        assert offset % m.dtype.itemsize == 0  # widest first: SGLang's check holds
        out.append(FlatTensor(m.name, tuple(m.shape), m.dtype, offset, offset + size, size))
        offset += size
    return tuple(out)


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def distributed_updates(
    metadata: Any,
    *,
    bucket_bytes: int = BUCKET_BYTES,
    load_format: Literal["flattened_bucket"] | None = "flattened_bucket",
) -> tuple[DistributedUpdate, ...]:
    """The ``update_weights_from_distributed`` calls that carry a stream: known from its
    metadata (a :class:`~fsdp_precision.WeightStream` or its ``metadata``) before any gather.

    Consecutive tensors up to ``bucket_bytes`` per call (a larger tensor alone), each in the
    dtype the stream yields it in (kept tensors in theirs). With ``"flattened_bucket"`` a call's
    tensors are listed widest elements first, so that every offset SGLang computes is aligned
    (fp32 never after an odd-sized bf16 tensor); with ``None``, in the stream's order."""
    metas = list(getattr(metadata, "metadata", metadata))
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes}; pass a positive number of bytes")
    if load_format not in ("flattened_bucket", None):
        raise ValueError(f"load_format={load_format!r}; pass 'flattened_bucket' or None")
    for m in metas:
        if getattr(torch, dtype_name(m.dtype), None) != m.dtype:
            raise ValueError(f"{m.name}: SGLang cannot name dtype {m.dtype}")
    calls: list[list[Any]] = []
    size = 0
    for m in metas:
        nbytes = m.dtype.itemsize * _numel(m.shape)
        if not calls or size + nbytes > bucket_bytes:
            calls.append([])
            size = 0
        calls[-1].append(m)
        size += nbytes
    updates = []
    for call in calls:
        if load_format == "flattened_bucket":
            call = sorted(call, key=lambda m: -m.dtype.itemsize)  # stable: order kept per size
        updates.append(
            DistributedUpdate(
                names=tuple(m.name for m in call),
                dtypes=tuple(dtype_name(m.dtype) for m in call),
                shapes=tuple(tuple(m.shape) for m in call),
                load_format=load_format,
                flat=_flat(call) if load_format == "flattened_bucket" else (),
            )
        )
    return tuple(updates)


def update_payloads(
    stream: Iterable[tuple[str, torch.Tensor]], updates: Sequence[DistributedUpdate]
) -> Iterator[tuple[DistributedUpdate, list[torch.Tensor]]]:
    """Iterate ``stream`` (collective, as always) and yield, per call of ``updates``, what rank 0
    of SGLang's update group broadcasts, in order: the bucket's bytes (one ``uint8`` tensor)
    for ``"flattened_bucket"``, the tensors themselves otherwise. One call's tensors in memory at
    a time. A stream that differs from the updates' metadata raises ``ValueError``."""
    items = iter(stream)
    for update in updates:
        got = dict(item for _, item in zip(update.names, items, strict=False))
        for name, dtype, shape in zip(update.names, update.dtypes, update.shapes, strict=True):
            t = got.get(name)
            if t is None or dtype_name(t.dtype) != dtype or tuple(t.shape) != shape:
                seen = None if t is None else (dtype_name(t.dtype), tuple(t.shape))
                raise ValueError(
                    f"{name}: the stream yields {seen}, the update lists {(dtype, shape)}; "
                    "build the updates from this stream's metadata"
                )
        if update.load_format is None:
            yield update, [got[n] for n in update.names]
            continue
        first = got[update.names[0]]
        buffer = torch.empty(update.flat[-1].end_idx, dtype=torch.uint8, device=first.device)
        for f in update.flat:
            flat = got[f.name].detach().reshape(-1).contiguous().view(torch.uint8)
            buffer[f.start_idx : f.end_idx].copy_(flat)
        yield update, [buffer]
    extra = next(items, None)
    if extra is not None:
        raise ValueError(f"{extra[0]}: the stream yields it, no update lists it")
