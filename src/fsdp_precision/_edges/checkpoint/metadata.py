"""A checkpoint's metadata: the library's JSON marker, and DCP's (tensor shapes and dtypes)."""

from __future__ import annotations

import json
import os
import reprlib
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fsdp_precision._base.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReadError,
)
from fsdp_precision._base.version import __version__
from fsdp_precision._edges.checkpoint.atomic import METADATA_FILE, recover, write_json
from fsdp_precision._edges.checkpoint.state import StateDictType
from fsdp_precision._trust.reader import METADATA_NAME
from fsdp_precision._trust.unpickle import load_metadata

__all__ = [
    "MAX_EXTRA_DEPTH",
    "MODEL",
    "OPTIM",
    "check_extra",
    "dcp_metadata",
    "read_checkpoint_metadata",
    "read_metadata",
    "saved_tensors",
    "write_metadata",
]

_FORMAT = "fsdp_precision.checkpoint"
_FORMAT_VERSION = 1
#: The top-level keys of the state a checkpoint holds.
MODEL, OPTIM = "model", "optim"
_REQUIRED = ("state_dict_type", "step", "world_size", "has_optimizer")


def read_checkpoint_metadata(checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON metadata of a complete checkpoint (step, type, world size, versions).

    Raises :class:`CheckpointNotFoundError` when the directory is missing or is not a complete
    ``fsdp_precision`` checkpoint, :class:`CheckpointReadError` when its metadata is corrupt or
    foreign. Local: no collective.
    """
    return read_metadata(recover(Path(checkpoint_dir)))


def read_metadata(path: Path) -> dict[str, Any]:
    """The metadata of the checkpoint directory ``path``, checked for format and fields."""
    meta_path = path / METADATA_FILE
    if not meta_path.is_file():
        raise CheckpointNotFoundError(
            f"checkpoint directory '{path}' is not a complete fsdp_precision checkpoint (no "
            f"{METADATA_FILE}); pass a directory written by save_checkpoint(), or check that "
            "its save finished"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise CheckpointReadError(
            f"cannot read '{meta_path}': {err}; the checkpoint's metadata is damaged: load an "
            "earlier checkpoint, or save this one again"
        ) from err
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointReadError(
            f"'{meta_path}' has format {found!r}, not {_FORMAT!r}; pass a directory written by "
            "save_checkpoint()"
        )
    absent = [k for k in _REQUIRED if k not in meta]
    if absent:
        raise CheckpointReadError(
            f"'{meta_path}' lacks the field(s) {absent}; the checkpoint's metadata is damaged: "
            "load an earlier checkpoint, or save this one again"
        )
    wrong = [
        f"{k}={meta.get(k)!r}" for k, valid in _FIELDS.items() if k in meta and not valid(meta[k])
    ]
    if wrong:
        raise CheckpointReadError(
            f"'{meta_path}' has field(s) of the wrong type or range: {', '.join(wrong)}; the "
            "checkpoint's metadata is damaged or foreign: load an earlier checkpoint, or save "
            "this one again"
        )
    return cast(dict[str, Any], meta)


def _int(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


#: Each field's check: what a marker this release writes holds.
_FIELDS: dict[str, Any] = {
    "format_version": lambda v: _int(v, 1) and v <= _FORMAT_VERSION,
    "state_dict_type": lambda v: v in ("full", "sharded"),
    "step": lambda v: v is None or _int(v, 0),
    "world_size": lambda v: _int(v, 1),
    "has_optimizer": lambda v: isinstance(v, bool),
    "extra": lambda v: isinstance(v, dict),
    "precision": lambda v: isinstance(v, dict),
    "optimizer_stateless": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
}


#: The deepest ``extra`` a save takes: JSON nested deeper than this is refused (Python's JSON
#: encoder and decoder recurse per level, so a much deeper value could not be written, or read
#: back by a load running deeper in the stack).
MAX_EXTRA_DEPTH = 100


def check_extra(extra: object) -> None:
    """Refuse (:class:`CheckpointError`, before anything is written) an ``extra`` that is not a
    mapping of JSON values nested at most :data:`MAX_EXTRA_DEPTH` levels."""
    if extra is None:
        return
    if not isinstance(extra, Mapping):
        shown = reprlib.repr(extra)  # bounded: a deeply nested value has no full repr
        raise CheckpointError(f"extra={shown} is not a mapping; pass a dict of JSON values")
    try:
        text = json.dumps(dict(extra))
    except RecursionError as err:
        raise CheckpointError(_too_deep(reprlib.repr(extra))) from err
    except (TypeError, ValueError) as err:
        raise CheckpointError(
            f"extra is not JSON-serialisable ({err}); keep it to numbers, strings, lists and "
            "dicts (tensors go in the model or optimizer state)"
        ) from err
    if _json_depth(text) > MAX_EXTRA_DEPTH:
        raise CheckpointError(_too_deep(reprlib.repr(extra)))


def _too_deep(shown: str) -> str:
    return (
        f"extra={shown} nests deeper than {MAX_EXTRA_DEPTH} levels; flatten it (e.g. join "
        "the nested keys into one, 'a/b/c': value) before saving"
    )


def _json_depth(text: str) -> int:
    """How deep the containers of the JSON ``text`` nest (without recursing)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def write_metadata(
    path: Path,
    kind: StateDictType,
    step: int | None,
    world: int,
    *,
    has_optimizer: bool,
    extra: Mapping[str, Any] | None = None,
    precision: Mapping[str, Any] | None = None,
    optimizer_stateless: list[str] | None = None,
    checksums: Mapping[str, Any] | None = None,
) -> None:
    """Write the marker that completes the checkpoint directory ``path`` (atomically, last).

    ``precision``: the model's layout, bulk dtype, kept tensors and boundary casts
    (:func:`fsdp_precision._edges.record.precision_record`), for exports made from the
    directory alone."""
    meta = {
        "extra": dict(extra or {}),
        "precision": dict(precision or {}),
        "optimizer_stateless": list(optimizer_stateless or []),
        "checksums": dict(checksums) if checksums is not None else None,
        "format": _FORMAT,
        "format_version": _FORMAT_VERSION,
        "state_dict_type": kind,
        "step": step,
        "world_size": world,
        "has_optimizer": has_optimizer,
        "torch_version": torch.__version__,
        "fsdp_precision_version": __version__,
        "saved_at_unix": time.time(),
    }
    write_json(path / METADATA_FILE, meta)


def dcp_metadata(path: Path) -> Any:
    """DCP's metadata of checkpoint ``path``, read as data only (nothing in it runs):
    :class:`UnsafeCheckpointError` for anything else, :class:`CheckpointReadError` when it is
    missing or damaged."""
    return load_metadata(path / METADATA_NAME)


#: A saved tensor's global shape and dtype.
SavedTensor = tuple[tuple[int, ...], torch.dtype]


def saved_tensors(path: Path, prefix: str = MODEL) -> dict[str, SavedTensor]:
    """Shape and dtype of every tensor saved under the top-level key ``prefix``, by inner key.

    Reads DCP's ``.metadata`` file through the allow-list (:func:`dcp_metadata`).
    """
    metadata = dcp_metadata(path)
    mapping = metadata.planner_data or {}
    found: dict[str, SavedTensor] = {}
    for flat_key, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        route = mapping.get(flat_key, tuple(flat_key.split(".", 1)))
        if len(route) == 2 and route[0] == prefix:
            found[str(route[1])] = (tuple(int(s) for s in meta.size), meta.properties.dtype)
    return found
