"""Sharded safetensors as Hugging Face writes them, one shard in memory at a time.

The split into files is Hugging Face's own (``huggingface_hub.split_torch_state_dict_into_shards``,
greedy in order, a tensor over the limit alone in its file), computed on meta tensors before any
data exists; each file is written with ``safetensors.torch.save_file`` as soon as its last tensor
arrives, and the index (``<weights>.index.json``) lists every tensor's file.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fsdp_precision._base.errors import CheckpointError

__all__ = ["ShardPlan", "ShardWriter", "check_shard_size", "plan_shards"]


def _file_mode() -> int:
    """The mode ``open()`` gives a new file under this process's umask (Linux reports it in
    ``/proc/self/status``, read without changing it; elsewhere the usual 0o644)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    return 0o644


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


@dataclass
class ShardWriter:
    """Collects the stream's tensors and writes each file once its last tensor arrived.

    Holds at most the files still waiting for a tensor (one, for a stream in the plan's order).
    """

    directory: Path
    plan: ShardPlan
    metadata: dict[str, str] = field(default_factory=lambda: {"format": "pt"})
    _pending: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    _file_of: dict[str, str] = field(default_factory=dict)
    written: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._file_of = {n: f for f, names in self.plan.files.items() for n in names}
        for f, names in self.plan.files.items():
            if not names:
                self._write(f, {})

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Take one tensor; write its file when it was the file's last."""
        file = self._file_of[name]
        pending = self._pending.setdefault(file, {})
        pending[name] = tensor.contiguous()
        if len(pending) == len(self.plan.files[file]):
            self._write(file, self._pending.pop(file))

    def close(self) -> list[str]:
        """Write the index (when sharded); every file written. ``RuntimeError`` when a tensor the
        plan expects never came."""
        if self._pending:
            missing = {f: len(self.plan.files[f]) - len(t) for f, t in self._pending.items()}
            raise RuntimeError(f"tensors never arrived for {missing}")
        if self.plan.index is not None:
            index: dict[str, Any] = {
                "metadata": {"total_size": self.plan.total_size},
                "weight_map": self._file_of,
            }
            (self.directory / self.plan.index).write_text(json.dumps(index, indent=2) + "\n")
            self.written.append(self.plan.index)
        return list(self.written)

    def _write(self, file: str, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file  # lazy: an optional dependency

        path = self.directory / file
        save_file(tensors, str(path), metadata=self.metadata)
        os.chmod(path, _file_mode())  # safetensors creates 0600 files; others read an export
        self.written.append(file)
