"""Weights to an engine in another process: the metadata first, then the tensors in their own
dtypes, over ``torch.distributed``.

What RL frameworks do between a trainer and an engine (vLLM's NCCL weight transfer, SGLang's
``update_weights_from_distributed(names, dtypes, shapes)``), with the kept dtypes in the metadata:
the sender broadcasts every tensor's name, dtype, shape and why it is kept (JSON, never pickle)
before any gather, then the tensors in buckets: consecutive tensors packed as bytes, each at an
offset aligned to 16 bytes (an odd-sized bf16 tensor ahead of an fp32 one cannot break the fp32
view, which unpadded buckets do: "storage_offset() must be divisible by 4"), one broadcast per
bucket. The receiver allocates each bucket from the metadata alone and yields views into it in
order, unit by unit as they were gathered: what an engine's ``load_weights`` takes.

The group is any process group holding the sender and the receivers: one registered with
``torch.distributed`` (``new_group``) or a standalone backend (:func:`weight_group`, a TCP store
of its own, for an engine that is not part of the trainer's world). Collectives go through the
group's own ``broadcast`` method, which both have; ``src`` is a rank within the group.

The metadata can also travel another way: an engine's own control plane (vLLM's RL API sends
``names``, ``dtype_names``, ``shapes`` in its update request). :func:`wire_metas` reads those
lists, :func:`send_tensors` and :func:`receive_tensors` move the tensors alone, in the same
buckets.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore

from fsdp_precision._base.devices import group_device
from fsdp_precision._base.dtypes import dtype_name

__all__ = [
    "ALIGN",
    "ReceivedWeights",
    "WireMeta",
    "receive_tensors",
    "receive_weights",
    "send_tensors",
    "send_weights",
    "weight_group",
    "wire_metas",
]

#: Every tensor starts at a multiple of this many bytes in its bucket.
ALIGN = 16
#: Bytes per bucket unless asked otherwise (a tensor larger than a bucket travels alone).
BUCKET_BYTES = 256 * 2**20
_FORMAT = "fsdp_precision.weights/1"
_WIRE_DTYPES = {
    dtype_name(d): d
    for d in (
        torch.float64, torch.float32, torch.bfloat16, torch.float16,
        torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}  # fmt: skip


#: A ``torch.distributed`` process group, or a backend (``ProcessGroupGloo``,
#: ``ProcessGroupNCCL``): anything with the c10d ``broadcast(tensors, options)`` method.
Group = Any


@dataclass(frozen=True)
class WireMeta:
    """One tensor on the wire: its name, dtype, full shape, and why it is kept (``None``: the
    bulk)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    kept: str | None

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def weight_group(
    address: str,
    port: int,
    rank: int,
    world_size: int,
    *,
    backend: str = "gloo",
    timeout: timedelta = timedelta(minutes=10),
) -> Group:
    """A group of its own between a trainer rank and an engine's ranks, outside either side's
    default process group: rank 0 hosts the TCP store at ``address:port``. ``backend``:
    ``"gloo"`` (CPU tensors) or ``"nccl"`` (GPU tensors)."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}; pass 'gloo' (CPU) or 'nccl' (GPU)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is not in [0, {world_size}); pass this process's rank")
    store = dist.TCPStore(  # type: ignore[attr-defined]  # exported at runtime
        address, port, world_size, is_master=rank == 0, timeout=timeout
    )
    prefixed = PrefixStore("fsdp_precision", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)


def _broadcast(group: Group, tensor: torch.Tensor, src: int) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = src
    group.broadcast([tensor], options).wait()


def _layout(metas: Sequence[WireMeta], bucket_bytes: int) -> list[list[tuple[WireMeta, int]]]:
    """Buckets of (tensor, byte offset): consecutive tensors, offsets aligned to :data:`ALIGN`."""
    buckets: list[list[tuple[WireMeta, int]]] = []
    current: list[tuple[WireMeta, int]] = []
    end = 0
    for meta in metas:
        offset = -(-end // ALIGN) * ALIGN
        if current and offset + meta.nbytes > bucket_bytes:
            buckets.append(current)
            current, offset = [], 0
        current.append((meta, offset))
        end = offset + meta.nbytes
    if current:
        buckets.append(current)
    return buckets


def _size(bucket: Sequence[tuple[WireMeta, int]]) -> int:
    meta, offset = bucket[-1]
    return max(offset + meta.nbytes, 1)


def send_weights(
    stream: Any,
    group: Group,
    *,
    src: int = 0,
    device: torch.device | str | None = None,
    bucket_bytes: int = BUCKET_BYTES,
) -> int:
    """Broadcast ``stream`` (a :class:`~fsdp_precision.WeightStream`) from rank ``src`` of
    ``group``: its metadata, then its tensors in their dtypes. Returns the bytes sent.

    Every rank of the trainer iterates the stream (its gathers are collective over the model's
    own group); call this on the trainer rank that is ``src`` in ``group`` and
    ``stream.drain()`` on the trainer's other ranks. ``device``: where buckets are packed
    (default: the group's device, the GPU for NCCL, the CPU for gloo)."""
    _check_bucket_bytes(bucket_bytes)
    metas = [WireMeta(m.name, m.dtype, tuple(m.shape), m.kept) for m in stream.metadata]
    header = json.dumps(
        {
            "format": _FORMAT,
            "bucket_bytes": bucket_bytes,
            "tensors": [[m.name, dtype_name(m.dtype), list(m.shape), m.kept] for m in metas],
        }
    ).encode()
    target = torch.device(device) if device is not None else group_device(group)
    _send_header(group, header, src, target)
    return send_tensors(metas, stream, group, src=src, device=target, bucket_bytes=bucket_bytes)


def _check_bucket_bytes(bucket_bytes: int) -> None:
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes={bucket_bytes}; pass at least {ALIGN}")


def wire_metas(
    names: Sequence[str],
    dtype_names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    kept: Sequence[str | None] | None = None,
) -> list[WireMeta]:
    """The tensors an engine's update request announces (vLLM's ``names``, ``dtype_names``
    (``"bfloat16"``), ``shapes``), as :class:`WireMeta`. ``ValueError`` naming the entry for
    lists of different lengths, a dtype outside the wire's or a negative size."""
    kept = [None] * len(names) if kept is None else kept
    lengths = {len(names), len(dtype_names), len(shapes), len(kept)}
    if len(lengths) != 1:
        raise ValueError(
            f"names, dtype_names, shapes and kept have {len(names)}, {len(dtype_names)}, "
            f"{len(shapes)} and {len(kept)} entries; pass one entry per tensor in each"
        )
    metas = []
    for name, dtype, shape, why in zip(names, dtype_names, shapes, kept, strict=True):
        wire = _WIRE_DTYPES.get(str(dtype).removeprefix("torch."))
        if wire is None or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise ValueError(
                f"{name}: dtype {dtype!r}, shape {list(shape)!r}; pass a dtype among "
                f"{sorted(_WIRE_DTYPES)} and sizes >= 0"
            )
        metas.append(WireMeta(name, wire, tuple(int(s) for s in shape), why))
    return metas


def send_tensors(
    metas: Sequence[WireMeta],
    tensors: Iterable[tuple[str, torch.Tensor]],
    group: Group,
    *,
    src: int = 0,
    device: torch.device | str | None = None,
    bucket_bytes: int = BUCKET_BYTES,
) -> int:
    """Broadcast ``tensors`` (what ``metas`` announced, in that order) from rank ``src`` of
    ``group`` in buckets, without the metadata (the receivers have it already:
    :func:`receive_tensors`). Returns the bytes sent.

    Each tensor is checked against its entry as it comes (name, dtype, shape): the receivers
    cut their buckets from the metadata, so a source that yields anything else raises
    ``ValueError`` naming the first difference instead of sending bytes they would misread."""
    _check_bucket_bytes(bucket_bytes)
    target = torch.device(device) if device is not None else group_device(group)
    items = iter(tensors)
    sent = index = 0
    for bucket in _layout(metas, bucket_bytes):
        buffer = torch.empty(_size(bucket), dtype=torch.uint8, device=target)
        for meta, offset in bucket:
            name, tensor = _next_checked(items, meta, index, len(metas))
            flat = tensor.detach().reshape(-1).contiguous().view(torch.uint8)
            buffer[offset : offset + meta.nbytes].copy_(flat)
            index += 1
        _broadcast(group, buffer, src)
        sent += buffer.numel()
    extra = next(items, None)
    if extra is not None:
        raise ValueError(
            f"the source yielded {extra[0]!r} after the {len(metas)} tensors its metadata "
            "announced; make its metadata list every tensor it yields"
        )
    return sent


def _next_checked(
    items: Iterator[tuple[str, torch.Tensor]], meta: WireMeta, index: int, total: int
) -> tuple[str, torch.Tensor]:
    item = next(items, None)
    if item is None:
        raise ValueError(
            f"the source stopped after {index} tensors; its metadata announced {total} (next: "
            f"{meta.name!r}); make its iteration yield every tensor its metadata lists"
        )
    name, tensor = item
    if name != meta.name or tensor.dtype != meta.dtype or tuple(tensor.shape) != meta.shape:
        raise ValueError(
            f"tensor {index}: the source yielded {name!r} {dtype_name(tensor.dtype)} "
            f"{tuple(tensor.shape)}, its metadata announced {meta.name!r} "
            f"{dtype_name(meta.dtype)} {meta.shape}; make both list the same tensors in order"
        )
    return name, tensor


def _send_header(group: Group, header: bytes, src: int, device: torch.device) -> None:
    length = torch.tensor([len(header)], dtype=torch.int64, device=device)
    _broadcast(group, length, src)
    _broadcast(group, torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device), src)


class ReceivedWeights:
    """The receiving side: iterable of ``(name, tensor)``, each tensor in the dtype the sender
    keeps it in, in the sender's order; :attr:`metadata` is known before any tensor arrives.

    Iterating receives (collective with :func:`send_weights`); one pass. Tensors are views into
    their bucket, which lives as long as any of them."""

    def __init__(
        self, group: Group, metas: list[WireMeta], src: int, bucket_bytes: int,
        device: torch.device,
    ) -> None:  # fmt: skip
        self._group, self._src, self._device = group, src, device
        self.metadata: tuple[WireMeta, ...] = tuple(metas)
        self._buckets = _layout(metas, bucket_bytes)

    @property
    def kept(self) -> dict[str, torch.dtype]:
        """The tensors sent in a dtype other than the bulk's: name -> dtype."""
        return {m.name: m.dtype for m in self.metadata if m.kept is not None}

    def drain(self) -> None:
        """Take part in every broadcast left without keeping anything (a refused update)."""
        for _ in self:
            pass

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self._buckets:
            buffer = torch.empty(_size(bucket), dtype=torch.uint8, device=self._device)
            _broadcast(self._group, buffer, self._src)
            for meta, offset in bucket:
                raw = buffer[offset : offset + meta.nbytes]
                yield meta.name, raw.view(meta.dtype).reshape(meta.shape)


def receive_weights(
    group: Group, *, src: int = 0, device: torch.device | str | None = None
) -> ReceivedWeights:
    """Receive the metadata :func:`send_weights` sends (collective), and return the weights to
    iterate: pass them to the engine's loader. ``device``: where they arrive (default: the
    group's device, the GPU for NCCL, the CPU for gloo). A header that is not this library's, or
    names a dtype outside the wire's, raises ``ValueError`` before any tensor is received."""
    target = torch.device(device) if device is not None else group_device(group)
    length = torch.empty(1, dtype=torch.int64, device=target)
    _broadcast(group, length, src)
    raw = torch.empty(int(length.item()), dtype=torch.uint8, device=target)
    _broadcast(group, raw, src)
    metas, bucket_bytes = _parse_header(bytes(raw.cpu().numpy().tobytes()))
    return ReceivedWeights(group, metas, src, bucket_bytes, target)


def receive_tensors(
    metas: Sequence[WireMeta],
    group: Group,
    *,
    src: int = 0,
    device: torch.device | str | None = None,
    bucket_bytes: int = BUCKET_BYTES,
) -> ReceivedWeights:
    """The receiving side of :func:`send_tensors`: the weights ``metas`` announce, to iterate
    (collective). ``bucket_bytes`` must be the sender's; ``device``: where they arrive (default:
    the group's device)."""
    _check_bucket_bytes(bucket_bytes)
    target = torch.device(device) if device is not None else group_device(group)
    return ReceivedWeights(group, list(metas), src, bucket_bytes, target)


def _parse_header(data: bytes) -> tuple[list[WireMeta], int]:
    def bad(what: str) -> ValueError:
        return ValueError(f"the weights' header is not {_FORMAT!r}: {what}; send with send_weights")

    try:
        header = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise bad(f"unreadable JSON ({err})") from err
    if not isinstance(header, dict) or header.get("format") != _FORMAT:
        raise bad(f"format {header.get('format') if isinstance(header, dict) else header!r}")
    bucket_bytes = header.get("bucket_bytes")
    tensors = header.get("tensors")
    if not isinstance(bucket_bytes, int) or bucket_bytes < ALIGN or not isinstance(tensors, list):
        raise bad("bucket_bytes or tensors missing")
    metas = []
    for entry in tensors:
        if not (isinstance(entry, list) and len(entry) == 4):
            raise bad(f"entry {entry!r}")
        name, dtype, shape, kept = entry
        if (
            not isinstance(name, str)
            or dtype not in _WIRE_DTYPES
            or not isinstance(shape, list)
            or not all(isinstance(s, int) and s >= 0 for s in shape)
            or not isinstance(kept, (str, type(None)))
        ):
            raise bad(f"entry {entry!r}")
        metas.append(WireMeta(name, _WIRE_DTYPES[dtype], tuple(shape), kept))
    return metas, bucket_bytes
