"""Sharded safetensors as Hugging Face writes them, written as the tensors arrive.

The split into files is Hugging Face's own (``huggingface_hub.split_torch_state_dict_into_shards``,
greedy in order, a tensor over the limit alone in its file), computed on meta tensors before any
data exists; each file's header is written when its first tensor arrives and each tensor's bytes
as it comes; the index (``<weights>.index.json``) lists every tensor's file.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from fsdp_precision._base.errors import CheckpointError

__all__ = ["ShardPlan", "ShardWriter", "check_shard_size", "plan_shards"]


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)\s*$", re.IGNORECASE)
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def check_shard_size(size: object) -> int:
    """``max_shard_size`` in bytes: a positive int, or ``"5GB"``/``"500MB"``/``"2GiB"`` (decimal
    units as Hugging Face's, binary with ``i``); ``ValueError`` else."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = _SIZE.match(size) if isinstance(size, str) else None
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(
            f"max_shard_size={size!r} is not a size; pass a positive number of bytes or a "
            "string such as '5GB' (Hugging Face's default), '500MB' or '2GiB'"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


@dataclass(frozen=True)
class ShardPlan:
    """Which file each tensor goes to.

    Attributes:
        files: File name -> its tensors' names, in the order they arrive.
        index: The index file name when there are several files, else ``None``.
        total_size: Bytes of every tensor together.
    """

    files: dict[str, list[str]]
    index: str | None
    total_size: int

    @property
    def entry(self) -> str:
        """What a loader opens: the index, or the single file."""
        return self.index if self.index is not None else next(iter(self.files))


def plan_shards(
    metadata: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
    weights_name: str,
    max_shard_size: int,
) -> ShardPlan:
    """Split ``(name, dtype, shape)`` into files named as Hugging Face names them."""
    try:  # lazy: an optional dependency (transformers and diffusers bring it)
        from huggingface_hub import split_torch_state_dict_into_shards
    except ImportError as exc:
        raise CheckpointError(
            "a safetensors export needs huggingface_hub, which is not installed; "
            "pip install 'fsdp-precision[hf]'"
        ) from exc
    meta = {n: torch.empty(s, dtype=d, device="meta") for n, d, s in metadata}
    pattern = weights_name.replace(".safetensors", "{suffix}.safetensors")
    split = split_torch_state_dict_into_shards(
        meta, filename_pattern=pattern, max_shard_size=max_shard_size
    )
    files = {f: list(names) for f, names in split.filename_to_tensors.items()}
    if not files:  # nothing to write: one empty file, which loaders accept
        files = {weights_name: []}
    index = f"{weights_name}.index.json" if split.is_sharded else None
    total = sum(t.numel() * t.element_size() for t in meta.values())
    return ShardPlan(files, index, total)


class ShardWriter:
    """Writes each file of a plan as its tensors arrive: the header first (every tensor's dtype,
    shape and place are known from the plan), then each tensor's bytes at its place the moment
    it comes. Nothing waits in memory for the rest of its file.

    The format is safetensors' (an 8-byte little-endian header length, the JSON header padded
    with spaces to 8 bytes, the tensors' bytes back to back), laid out as safetensors lays it
    out: wider dtypes first, so that every tensor starts at a multiple of its element size.
    safetensors itself writes a file only from tensors held in memory at once (and copies them
    into bytes first): one output file, twice, on top of the unit being gathered. The tests read
    every file back with safetensors and ``from_pretrained``.
    """

    def __init__(
        self,
        directory: Path,
        plan: ShardPlan,
        tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.directory = directory
        self.plan = plan
        self._tensors = tensors
        self._metadata = {"format": "pt", **(metadata or {})}
        self._file_of = {n: f for f, names in plan.files.items() for n in names}
        self._place: dict[str, int] = {}  # tensor -> byte offset of its data in its file
        self._left: dict[str, int] = {f: len(names) for f, names in plan.files.items()}
        self._open: dict[str, BinaryIO] = {}
        self.written: list[str] = []
        for file, names in plan.files.items():
            if not names:
                self._start(file).close()
                self.written.append(file)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Write one tensor at its place in its file (opened at its first tensor to arrive,
        closed after its last)."""
        file = self._file_of.get(name)
        dtype, shape = self._tensors.get(name, (None, ()))
        if file is None or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise RuntimeError(  # the stream yields what its metadata said
                f"{name!r} {tensor.dtype} {tuple(tensor.shape)} is not in the plan as such"
            )
        handle = self._open.get(file) or self._start(file)
        handle.seek(self._place[name])
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        handle.write(data.data)  # the tensor's own bytes, no copy
        self._left[file] -= 1
        if self._left[file] == 0:
            handle.close()
            del self._open[file]
            self.written.append(file)

    def close(self) -> list[str]:
        """Write the index (when sharded); every file written. ``RuntimeError`` when a tensor the
        plan expects never came."""
        for handle in self._open.values():
            handle.close()
        unfinished = {f: self._left[f] for f in self._open}
        if unfinished:
            raise RuntimeError(f"tensors never arrived for {unfinished}")
        if self.plan.index is not None:
            index: dict[str, Any] = {
                "metadata": {"total_size": self.plan.total_size},
                "weight_map": self._file_of,
            }
            (self.directory / self.plan.index).write_text(json.dumps(index, indent=2) + "\n")
            self.written.append(self.plan.index)
        return list(self.written)

    def _start(self, file: str) -> BinaryIO:
        header: dict[str, Any] = {"__metadata__": self._metadata}
        names = sorted(self.plan.files[file], key=lambda n: -self._tensors[n][0].itemsize)
        offset = 0
        for name in names:
            dtype, shape = self._tensors[name]
            size = _numel(shape) * dtype.itemsize
            header[name] = {
                "dtype": _SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            self._place[name] = offset
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        start = 8 + len(encoded)
        for name in names:
            self._place[name] += start
        handle = open(self.directory / file, "wb")  # noqa: SIM115 - closed after its last tensor
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        handle.truncate(start + offset)  # the file's full size; each tensor fills its place
        self._open[file] = handle
        return handle


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _dtypes(pairs: dict[str, str]) -> dict[torch.dtype, str]:
    found = ((getattr(torch, name, None), code) for name, code in pairs.items())
    return {d: code for d, code in found if isinstance(d, torch.dtype)}


#: torch dtype -> safetensors' name for it (those this torch has).
_SAFETENSORS_DTYPES = _dtypes(
    {
        "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
        "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
        "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e4m3fnuz": "F8_E4M3FNUZ",
        "float8_e5m2": "F8_E5M2", "float8_e5m2fnuz": "F8_E5M2FNUZ", "uint16": "U16",
        "uint32": "U32", "uint64": "U64",
    }
)  # fmt: skip
