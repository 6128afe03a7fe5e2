"""What an inference engine must hold as training kept it, from what the library already writes.

There is one description of what was kept, not two: the record an export writes last
(``fsdp_precision_export.json``: every kept tensor and its dtype, the boundary casts training ran
the kept modules with) beside a model directory, and a weight stream's ``kept`` metadata and
``casts`` before any tensor of an update. :class:`EngineKept` is that description as an engine
reads it: checkpoint names (Hugging Face's, which engines map into their own), dtypes, casts.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._base.errors import EngineDtypeError
from fsdp_precision._edges.record import (
    EXPORT_RECORD,
    ExportRecord,
    RecordedCast,
    read_export_record,
)

__all__ = ["EngineKept", "kept_of_export", "kept_of_stream"]


@dataclass(frozen=True)
class EngineKept:
    """The tensors an engine must hold in a dtype other than the bulk's, and how their modules
    meet the activations.

    Attributes:
        tensors: Checkpoint name (Hugging Face's) -> the dtype training kept it in.
        casts: The boundary casts training ran kept modules with, by the model's module names
            (a router's input cast to fp32; a norm's outputs cast back).
        bulk: The dtype the rest of the model computes in.
        source: Where the description came from (the record's path, or ``"stream"``).
    """

    tensors: Mapping[str, torch.dtype]
    casts: tuple[RecordedCast, ...] = ()
    bulk: torch.dtype = torch.bfloat16
    source: str = "stream"
    _by_module: dict[str, RecordedCast] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._by_module.update({c.module: c for c in self.casts})

    def cast_of(self, module: str) -> RecordedCast | None:
        """The boundary cast training ran the module named ``module`` with, if any."""
        return self._by_module.get(module)

    def digest(self) -> str:
        """A short hash of what is kept (names, dtypes, casts, bulk): keys an engine's caches."""
        document = {
            "tensors": sorted((n, dtype_name(d)) for n, d in self.tensors.items()),
            "casts": sorted(
                (c.module, dtype_name(c.cast.inputs), c.cast.outputs, str(c.back))
                for c in self.casts
            ),
            "bulk": dtype_name(self.bulk),
        }
        return hashlib.sha256(json.dumps(document).encode()).hexdigest()[:16]

    def describe(self) -> str:
        """One line: how many tensors in which dtypes."""
        counts: dict[str, int] = {}
        for dtype in self.tensors.values():
            counts[dtype_name(dtype)] = counts.get(dtype_name(dtype), 0) + 1
        kinds = ", ".join(f"{n} in {d}" for d, n in sorted(counts.items()))
        return f"{len(self.tensors)} kept tensors ({kinds or 'none'}) from {self.source}"


def _from_record(record: ExportRecord, source: str) -> EngineKept:
    if record.layout != "transformers":
        raise EngineDtypeError(
            f"'{source}' is a {record.layout!r} export: inference engines load Hugging Face "
            "checkpoint names; export the model with layout='transformers' (the default for a "
            "transformers model)"
        )
    return EngineKept(
        tensors={k.name: k.dtype for k in record.kept},
        casts=record.casts,
        bulk=record.bulk,
        source=source,
    )


_cache: dict[tuple[str, int, int], EngineKept] = {}
_cache_lock = threading.Lock()


def kept_of_export(directory: str | os.PathLike[str]) -> EngineKept | None:
    """What the export in ``directory`` kept, or ``None`` where the directory holds no record
    (not written by ``export_safetensors``: the engine loads it as it would anyway). Read once
    per record file (path, size and modification time); the record is JSON, never code, and a
    damaged one raises :class:`~fsdp_precision.CheckpointReadError`."""
    path = Path(directory) / EXPORT_RECORD
    try:
        stat = path.stat()
    except OSError:
        return None
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    with _cache_lock:
        if key not in _cache:
            _cache[key] = _from_record(read_export_record(directory), str(path))
        return _cache[key]


def kept_of_stream(stream: Any) -> EngineKept:
    """What a :class:`~fsdp_precision.WeightStream` keeps (its ``kept`` metadata and ``casts``),
    as an engine reads it."""
    if stream.layout != "transformers":
        raise EngineDtypeError(
            f"the stream's layout is {stream.layout!r}: inference engines load Hugging Face "
            "checkpoint names; build it with full_weights(model, layout='auto') on a "
            "transformers model"
        )
    return EngineKept(
        tensors={m.name: m.dtype for m in stream.metadata if m.kept is not None},
        casts=tuple(stream.casts),
        bulk=stream.bulk,
        source="stream",
    )
