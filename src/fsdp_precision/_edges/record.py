"""The record an export writes last (its completion marker): which tensors were kept in which
dtype and why, the boundary casts training ran them with, and the files the export wrote.

:func:`fsdp_precision.checkpoint.restore_kept` reads it to put kept tensors back exactly after a
library's own loader rounded them (``from_pretrained(dtype=torch.bfloat16)`` rounds a router the
model does not declare kept).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fsdp_precision._base.dtypes import dtype_from_name, dtype_name, optional_name
from fsdp_precision._base.errors import CheckpointNotFoundError, CheckpointReadError
from fsdp_precision._base.version import __version__
from fsdp_precision._edges.entries import strip_wrappers, weight_entries
from fsdp_precision._policy.casts import (
    ModuleCast,
    install_cast,
    installed_back,
    installed_cast,
)

__all__ = [
    "EXPORT_RECORD",
    "ExportRecord",
    "KeptTensor",
    "RecordedCast",
    "casts_json",
    "install_casts",
    "kept_tensors",
    "parse_casts",
    "precision_record",
    "read_export_record",
    "recorded_casts",
]

#: Written last into an export directory: its presence marks the export complete.
EXPORT_RECORD = "fsdp_precision_export.json"
_FORMAT = "fsdp_precision.export"
_FORMAT_VERSION = 1


@dataclass(frozen=True)
class KeptTensor:
    """A tensor an export holds in a dtype other than the bulk's.

    Attributes:
        name: Its name in the export's files.
        dtype: The dtype it is stored in there.
        reason: Why (the rule or declaration that kept it, or what computed it so).
        param: The model's state-dict name to restore it into; ``None`` where a layout
            conversion made the tensor from several (not restorable by name).
    """

    name: str
    dtype: torch.dtype
    reason: str
    param: str | None


@dataclass(frozen=True)
class RecordedCast:
    """A boundary cast training ran a kept module with.

    Attributes:
        module: The module's FQN in the model.
        cast: Its :class:`ModuleCast`.
        back: The dtype outputs were cast back to (``None``: the dtype they came in).
    """

    module: str
    cast: ModuleCast
    back: torch.dtype | None


@dataclass(frozen=True)
class ExportRecord:
    """What an export directory holds (read with :func:`read_export_record`).

    Attributes:
        layout: ``"transformers"``, ``"diffusers"``, ``"peft"`` or ``"plain"``.
        dtype: What was asked for: ``"stored"``, ``"compute"`` or the bulk dtype's name.
        bulk: The dtype training computed the bulk of the model in.
        weights: The weights file, or the shard index, relative to the directory.
        files: Every file the export wrote (the record excluded).
        tensors: How many tensors the weights hold.
        nbytes: Their bytes together.
        kept: The tensors stored in a dtype other than the bulk's.
        casts: The boundary casts training ran kept modules with.
        step: The training step, when given.
    """

    layout: str
    dtype: str
    bulk: torch.dtype
    weights: str
    files: tuple[str, ...]
    tensors: int
    nbytes: int
    kept: tuple[KeptTensor, ...]
    casts: tuple[RecordedCast, ...]
    step: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON document written to :data:`EXPORT_RECORD`."""
        return {
            "format": _FORMAT,
            "format_version": _FORMAT_VERSION,
            "layout": self.layout,
            "dtype": self.dtype,
            "bulk": dtype_name(self.bulk),
            "weights": self.weights,
            "files": list(self.files),
            "tensors": self.tensors,
            "bytes": self.nbytes,
            "step": self.step,
            "kept": {
                k.name: {"dtype": dtype_name(k.dtype), "reason": k.reason, "param": k.param}
                for k in self.kept
            },
            "casts": casts_json(self.casts),
            "torch_version": torch.__version__,
            "fsdp_precision_version": __version__,
        }


def read_export_record(export_dir: str | os.PathLike[str]) -> ExportRecord:
    """The record of an export written by ``export_safetensors``.

    Raises :class:`CheckpointNotFoundError` when ``export_dir`` holds none (not an export of
    this library, or one that did not finish) and :class:`CheckpointReadError` when it is
    damaged: every field is checked for its type before anything is used.
    """
    path = Path(export_dir) / EXPORT_RECORD
    if not path.is_file():
        raise CheckpointNotFoundError(
            f"'{export_dir}' holds no {EXPORT_RECORD}: it is not a complete export of "
            "fsdp_precision; pass a directory written by export_safetensors()"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointReadError(f"cannot read '{path}': {err}; export again") from err
    return _parse(data, path)


def _parse(data: object, path: Path) -> ExportRecord:
    def bad(what: str) -> CheckpointReadError:
        return CheckpointReadError(f"'{path}' is damaged or foreign: {what}; export again")

    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise bad(f"its format is not {_FORMAT!r}")
    if data.get("format_version") != _FORMAT_VERSION:
        raise bad(f"format_version {data.get('format_version')!r} is not {_FORMAT_VERSION}")
    fields = {
        "layout": str,
        "dtype": str,
        "weights": str,
        "files": list,
        "tensors": int,
        "bytes": int,
        "kept": dict,
        "casts": dict,
    }
    for name, kind in fields.items():
        if not isinstance(data.get(name), kind) or isinstance(data.get(name), bool):
            raise bad(f"field {name!r} is {data.get(name)!r}, not a {kind.__name__}")
    step = data.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise bad(f"field 'step' is {step!r}")
    bulk = dtype_from_name(data.get("bulk"))
    if bulk is None:
        raise bad(f"field 'bulk' is {data.get('bulk')!r}, not a floating dtype name")
    return ExportRecord(
        layout=data["layout"],
        dtype=data["dtype"],
        bulk=bulk,
        weights=_relative(data["weights"], bad),
        files=tuple(_relative(f, bad) for f in data["files"]),
        tensors=data["tensors"],
        nbytes=data["bytes"],
        kept=tuple(_kept(name, entry, bad) for name, entry in data["kept"].items()),
        casts=tuple(_cast(name, entry, bad) for name, entry in data["casts"].items()),
        step=step,
    )


def _relative(name: object, bad: Any) -> str:
    """A file name inside the directory (no separators, no parent)."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
        raise bad(f"file name {name!r} is not a plain name inside the directory")
    return name


def _kept(name: str, entry: object, bad: Any) -> KeptTensor:
    if not isinstance(entry, dict):
        raise bad(f"kept entry {name!r} is not an object")
    dtype = dtype_from_name(entry.get("dtype"))
    reason, param = entry.get("reason"), entry.get("param")
    if dtype is None or not isinstance(reason, str) or not isinstance(param, (str, type(None))):
        raise bad(f"kept entry {name!r} is {entry!r}")
    return KeptTensor(name, dtype, reason, param)


def _cast(module: str, entry: object, bad: Any) -> RecordedCast:
    if not isinstance(entry, dict):
        raise bad(f"cast entry {module!r} is not an object")
    inputs = dtype_from_name(entry.get("inputs"))
    back_name = entry.get("back")
    back = None if back_name is None else dtype_from_name(back_name)
    outputs = entry.get("outputs")
    if inputs is None or not isinstance(outputs, bool) or (back_name is not None and back is None):
        raise bad(f"cast entry {module!r} is {entry!r}")
    return RecordedCast(module, ModuleCast(inputs, outputs=outputs), back)


def kept_tensors(metadata: Sequence[Any]) -> tuple[KeptTensor, ...]:
    """The kept entries of a stream's metadata (``WeightMeta``)."""
    return tuple(KeptTensor(m.name, m.dtype, str(m.kept), m.param) for m in metadata if m.kept)


def install_casts(model: nn.Module, casts: Sequence[RecordedCast]) -> list[str]:
    """Install ``casts`` on ``model``'s modules of the same names (wrapper segments ignored);
    the names of those that got one. Modules that cast already, or that ``model`` lacks, are
    left alone."""
    modules = {strip_wrappers(n): m for n, m in model.named_modules()}
    done = []
    for recorded in casts:
        target = modules.get(strip_wrappers(recorded.module))
        if target is not None and installed_cast(target) is None:
            install_cast(target, recorded.cast, recorded.back)
            done.append(recorded.module)
    return done


def recorded_casts(model: nn.Module) -> tuple[RecordedCast, ...]:
    """The boundary casts installed on ``model``'s modules (wrapper segments removed)."""
    found = []
    for name, module in model.named_modules():
        cast = installed_cast(module)
        if cast is not None:
            found.append(RecordedCast(strip_wrappers(name), cast, installed_back(module)))
    return tuple(found)


def casts_json(casts: Sequence[RecordedCast]) -> dict[str, Any]:
    """``casts`` as a record's ``casts`` field (what :func:`parse_casts` reads back)."""
    return {
        c.module: {
            "inputs": dtype_name(c.cast.inputs),
            "outputs": c.cast.outputs,
            "back": optional_name(c.back),
        }
        for c in casts
    }


def parse_casts(data: object, where: str) -> tuple[RecordedCast, ...]:
    """The casts of a record's ``casts`` field; :class:`CheckpointReadError` when damaged."""

    def bad(what: str) -> CheckpointReadError:
        return CheckpointReadError(f"'{where}' is damaged or foreign: {what}")

    if not isinstance(data, dict):
        raise bad(f"its casts are {data!r}")
    return tuple(_cast(name, entry, bad) for name, entry in data.items())


def precision_record(model: nn.Module, layout: str) -> dict[str, Any]:
    """What a checkpoint's marker records of the model's precision: the layout, the bulk
    dtype, every kept tensor (state-dict name -> dtype, reason) and the boundary casts."""
    entries, bulk = weight_entries(model)
    return {
        "layout": layout,
        "bulk": dtype_name(bulk),
        "kept": {
            e.name: {"dtype": dtype_name(e.compute), "reason": e.kept} for e in entries if e.kept
        },
        "casts": casts_json(recorded_casts(model)),
    }
