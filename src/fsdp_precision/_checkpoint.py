"""Checkpoints of FSDP2 models with exact per-parameter dtypes, on ``torch.distributed.checkpoint``.

Two layers:

- :func:`model_state_dict` / :func:`load_model_state_dict`: in-memory state dicts ("full":
  consolidated CPU tensors on rank 0; "sharded": DTensors on every rank), validated before
  anything is loaded.
- :func:`save_checkpoint` / :func:`load_checkpoint`: model (+ optimizer) checkpoints on disk in
  DCP format, written atomically, loadable at another world size or mesh;
  :func:`export_safetensors` turns a model or a checkpoint into ``model.safetensors`` (+
  ``config.json``) for Hugging Face ``from_pretrained``.

Every tensor keeps its own dtype: a unit that stores some parameters in fp32 and others in bf16
saves and loads each in its own dtype. See ``docs/checkpoints.md``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from ._errors import CheckpointError, StateDictMismatchError

__all__ = [
    "METADATA_FILE",
    "StateDictType",
    "export_safetensors",
    "load_checkpoint",
    "load_model_state_dict",
    "model_state_dict",
    "read_checkpoint_metadata",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

StateDictType = Literal["full", "sharded"]
_TYPES: tuple[str, ...] = ("full", "sharded")

#: Written last into a checkpoint directory: its presence marks the checkpoint complete.
METADATA_FILE = "fsdp_precision_checkpoint.json"
_FORMAT = "fsdp_precision.checkpoint"
_FORMAT_VERSION = 1
_MODEL, _OPTIM = "model", "optim"


# --------------------------------------------------------------------------- helpers


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (identity without a process group)."""
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """Silence DCP's "assuming ... a single process" warning where one process is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _check_type(state_dict_type: object, *, name: str = "state_dict_type") -> StateDictType:
    if state_dict_type not in _TYPES:
        raise CheckpointError(
            f"{name}={state_dict_type!r} is not a state dict type; "
            f"pass {name}='full' (consolidated) or {name}='sharded' (DTensor shards per rank)"
        )
    return cast(StateDictType, state_dict_type)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)  # a DTensor's shape is its global shape


def _mismatch_error(
    what: str,
    destination: Mapping[str, tuple[int, ...]],
    incoming: Mapping[str, tuple[int, ...]],
) -> StateDictMismatchError | None:
    """The error listing every missing key, unexpected key and shape mismatch (None: they match)."""
    missing = sorted(k for k in destination if k not in incoming)
    unexpected = sorted(k for k in incoming if k not in destination)
    shapes = sorted(
        (k, incoming[k], destination[k])
        for k in destination
        if k in incoming and incoming[k] != destination[k]
    )
    if not (missing or unexpected or shapes):
        return None
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing key(s): {missing}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s): {unexpected}")
    if shapes:
        listed = ", ".join(f"{k!r} incoming {tuple(a)} vs model {tuple(b)}" for k, a, b in shapes)
        parts.append(f"{len(shapes)} shape mismatch(es): {listed}")
    return StateDictMismatchError(
        f"{what} does not match the model: {'; '.join(parts)}. Nothing was loaded; load a state "
        "dict of the same architecture, or rename, drop or reshape those keys before loading",
        missing=missing,
        unexpected=unexpected,
        shape_mismatches=[(k, tuple(a), tuple(b)) for k, a, b in shapes],
    )


def _raise_collectively(error: BaseException | None, *, local_only: bool) -> None:
    """Raise the first rank's error on every rank, so no rank enters a collective alone."""
    if local_only or not _distributed():
        if error is not None:
            raise error
        return
    gathered: list[BaseException | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, error)
    for item in gathered:
        if item is not None:
            raise item


def _template(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's sharded state dict: keys, global shapes and dtypes, without a gather."""
    return {k: v for k, v in get_model_state_dict(model).items() if isinstance(v, torch.Tensor)}


# --------------------------------------------------------------------------- state dicts


def model_state_dict(model: nn.Module, state_dict_type: StateDictType = "full") -> dict[str, Any]:
    """The model's state dict with every tensor in its own storage dtype.

    Collective: every rank of the model's process group must call it.

    - ``"full"``: consolidated tensors offloaded to CPU, **on rank 0 only**; every other rank gets
      ``{}`` (a full copy per rank would cost world-size times the memory). The matching
      :func:`load_model_state_dict` reads rank 0's dict and broadcasts it.
    - ``"sharded"``: every rank gets its DTensor shards (no gather, no copy).

    Built on :func:`torch.distributed.checkpoint.state_dict.get_model_state_dict`.
    """
    kind = _check_type(state_dict_type)
    if kind == "sharded":
        return get_model_state_dict(model)
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def load_model_state_dict(
    model: nn.Module,
    state_dict: Mapping[str, Any],
    state_dict_type: StateDictType = "full",
) -> None:
    """Load a state dict made by :func:`model_state_dict` (or any matching one) into ``model``.

    Collective: every rank must call it. ``"full"``: only rank 0's ``state_dict`` is read (other
    ranks may pass ``{}``); it is validated on rank 0 and broadcast tensor by tensor. ``"sharded"``:
    every rank passes its own DTensor shards.

    Keys and (global) shapes are checked first: missing keys, unexpected keys and shape
    mismatches raise :class:`StateDictMismatchError`, listing them all, on every rank, **before
    anything is modified**. A state dict of the other type (DTensors for ``"full"``, plain tensors
    where ``"sharded"`` expects DTensors) raises :class:`CheckpointError`.

    An incoming tensor whose dtype differs from the destination parameter's is cast to the
    destination dtype in a copy: the model keeps its dtypes, the caller's dict is not modified.

    Built on :func:`torch.distributed.checkpoint.state_dict.set_model_state_dict`.
    """
    kind = _check_type(state_dict_type)
    rank, _ = _rank_world()
    destination = _template(model)
    reads_input = kind == "sharded" or rank == 0
    error: BaseException | None = None
    if reads_input:
        error = _validate(destination, state_dict, kind)
    if kind == "full":
        error = _from_rank0(error)
        if error is not None:
            raise error
    else:
        _raise_collectively(error, local_only=False)

    prepared: dict[str, Any] = {}
    if reads_input:
        for key, value in state_dict.items():
            dest = destination.get(key)
            if isinstance(value, torch.Tensor) and dest is not None and value.dtype != dest.dtype:
                value = value.to(dest.dtype)  # a copy: the caller's tensor is left as it is
            prepared[key] = value
    options = StateDictOptions(
        full_state_dict=kind == "full",
        broadcast_from_rank0=kind == "full" and _distributed(),
        strict=True,
    )
    set_model_state_dict(model, prepared, options=options)


def _validate(
    destination: Mapping[str, torch.Tensor], state_dict: Mapping[str, Any], kind: StateDictType
) -> BaseException | None:
    if not isinstance(state_dict, Mapping):
        return CheckpointError(
            f"state_dict is a {type(state_dict).__name__}, not a mapping of names to tensors; "
            "pass the dict returned by model_state_dict()"
        )
    tensors = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
    if kind == "full":
        dtensors = sorted(k for k, v in tensors.items() if isinstance(v, DTensor))
        if dtensors:
            return CheckpointError(
                f"state_dict_type='full' got DTensor shards (e.g. {dtensors[0]!r}): this is a "
                "sharded state dict; pass state_dict_type='sharded', or make a full one with "
                "model_state_dict(model, 'full')"
            )
    else:
        plain = sorted(
            k
            for k, v in tensors.items()
            if isinstance(destination.get(k), DTensor) and not isinstance(v, DTensor)
        )
        if plain:
            return CheckpointError(
                f"state_dict_type='sharded' got plain tensors where the model has DTensor shards "
                f"(e.g. {plain[0]!r}): this is a full state dict; pass state_dict_type='full' "
                "(on rank 0), or make a sharded one with model_state_dict(model, 'sharded')"
            )
    return _mismatch_error(
        "state_dict",
        {k: _shape(v) for k, v in destination.items()},
        {k: _shape(v) for k, v in tensors.items()},
    )


# --------------------------------------------------------------------------- on disk


def read_checkpoint_metadata(checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON metadata of a complete checkpoint (step, type, world size, versions).

    Raises :class:`CheckpointError` when the directory is missing or is not a complete
    ``fsdp_precision`` checkpoint. Local: no collective.
    """
    path = _resolve(Path(checkpoint_dir))
    return _read_metadata(path)


def _read_metadata(path: Path) -> dict[str, Any]:
    meta_path = path / METADATA_FILE
    if not meta_path.is_file():
        raise CheckpointError(
            f"checkpoint directory '{path}' is not a complete fsdp_precision checkpoint (no "
            f"{METADATA_FILE}); pass a directory written by save_checkpoint(), or check that "
            "its save finished"
        )
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != _FORMAT:
        raise CheckpointError(
            f"'{meta_path}' has format {meta.get('format')!r}, not {_FORMAT!r}; pass a directory "
            "written by save_checkpoint()"
        )
    return cast(dict[str, Any], meta)


def _siblings(target: Path, tag: str) -> list[Path]:
    if not target.parent.is_dir():
        return []
    prefix = f"{target.name}.{tag}-"
    return sorted(p for p in target.parent.iterdir() if p.name.startswith(prefix) and p.is_dir())


def _resolve(target: Path) -> Path:
    """``target``, or the complete copy an interrupted save left next to it.

    The save protocol (see :func:`save_checkpoint`) can only leave ``target`` missing between its
    two renames; then both the previous checkpoint (``<dir>.old-<id>``) and the new one
    (``<dir>.tmp-<id>``, complete) exist. The new one is used.
    """
    if target.is_dir():
        return target
    for tag in ("tmp", "old"):
        complete = [p for p in _siblings(target, tag) if (p / METADATA_FILE).is_file()]
        if complete:
            chosen = max(complete, key=lambda p: (p / METADATA_FILE).stat().st_mtime)
            logger.warning(
                "checkpoint %s is missing; using %s left complete by an interrupted save",
                target,
                chosen,
            )
            return chosen
    raise CheckpointError(
        f"checkpoint directory '{target}' does not exist (and no complete copy left by an "
        "interrupted save is next to it); pass the directory given to save_checkpoint()"
    )


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prepare_target(target: Path) -> None:
    """Rank 0, before a save: finish or clean up what an interrupted save left behind."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        try:
            recovered = _resolve(target)
        except CheckpointError:
            recovered = None
        if recovered is not None:
            os.replace(recovered, target)
            logger.warning("moved %s, left by an interrupted save, back to %s", recovered, target)
    if target.exists():
        for stale in _siblings(target, "tmp") + _siblings(target, "old"):
            shutil.rmtree(stale, ignore_errors=True)


def _swap_into_place(tmp: Path, target: Path, token: str) -> None:
    """Rank 0: make the complete ``tmp`` the checkpoint at ``target``.

    At every instant either ``target`` is a complete checkpoint, or (between the two renames) both
    the previous one and the new one exist complete beside it, which :func:`load_checkpoint` and the
    next save recover.
    """
    old = target.with_name(f"{target.name}.old-{token}")
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    _fsync_dir(target.parent)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    state_dict_type: StateDictType = "sharded",
    step: int | None = None,
) -> Path:
    """Save ``model`` (and ``optimizer``) to ``checkpoint_dir`` atomically; return the path.

    Collective: every rank must call it with the same arguments. The directory must be on a
    filesystem every rank can see.

    - ``"sharded"``: every rank writes its own shards (``torch.distributed.checkpoint.save``);
      loadable at another world size and another mesh (FSDP 1-D <-> HSDP 2-D).
    - ``"full"``: the state is consolidated on rank 0, which alone writes it (also DCP format,
      loadable in the same ways; exportable with :func:`export_safetensors`).

    Atomic: everything is written into the sibling ``<dir>.tmp-<id>``; after a barrier rank 0
    renames the previous checkpoint to ``<dir>.old-<id>``, the new one to ``<dir>``, and deletes
    the old one. A crash at any point leaves the previous or the new checkpoint loadable, never a
    partial one. Metadata (step, type, world size, torch and library versions) goes to
    ``METADATA_FILE``, written last. A model with a Hugging Face ``config`` also gets its
    ``config.json``.
    """
    kind = _check_type(state_dict_type)
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise CheckpointError(
            f"step={step!r} is not an int; pass the training step as an int, or None"
        )
    rank, world = _rank_world()
    target = Path(checkpoint_dir).absolute()
    token: str | None = None
    failure: str | None = None
    if rank == 0:
        try:
            _prepare_target(target)
            token = uuid.uuid4().hex[:12]
            target.with_name(f"{target.name}.tmp-{token}").mkdir()
        except OSError as exc:
            failure = f"cannot prepare {target}: {exc}"
    token, failure = _from_rank0((token, failure))
    if failure is not None:
        raise OSError(failure)
    tmp = target.with_name(f"{target.name}.tmp-{token}")

    if kind == "sharded":
        state = _sharded_state(model, optimizer)
        dcp_save(state, checkpoint_id=tmp)
    else:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        if optimizer is None:
            state = {_MODEL: get_model_state_dict(model, options=options)}
        else:
            msd, osd = get_state_dict(model, optimizer, options=options)
            state = {_MODEL: msd, _OPTIM: osd}
        if rank == 0:
            with _single_process():
                dcp_save(state, checkpoint_id=tmp, no_dist=True)
    del state

    if rank == 0:
        try:
            config = getattr(model, "config", None)
            if config is not None and hasattr(config, "save_pretrained"):
                config.save_pretrained(tmp)
            _write_metadata(tmp, kind, step, world, has_optimizer=optimizer is not None)
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            failure = f"cannot finish {tmp}: {exc!r}"
    _barrier()  # every rank's shards are written (dcp.save also synchronises)
    if rank == 0 and failure is None:
        try:
            _swap_into_place(tmp, target, cast(str, token))
        except OSError as exc:
            failure = f"cannot move {tmp} to {target}: {exc!r}"
    failure = _from_rank0(failure)
    if failure is not None:
        raise OSError(failure)
    if rank == 0:
        logger.info("saved %s checkpoint (step %s) to %s", kind, step, target)
    return target


def _sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {_MODEL: get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {_MODEL: msd, _OPTIM: osd}


def _write_metadata(
    path: Path, kind: StateDictType, step: int | None, world: int, *, has_optimizer: bool
) -> None:
    from . import __version__  # the package is fully imported by the time a save runs

    meta = {
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
    tmp_file = path / f".{METADATA_FILE}.partial"
    with open(tmp_file, "w") as fh:
        json.dump(meta, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp_file, path / METADATA_FILE)
    _fsync_dir(path)


def _checkpoint_shapes(path: Path, prefix: str) -> dict[str, tuple[int, ...]]:
    """Shapes of the tensors saved under the top-level key ``prefix``, by their inner key."""
    metadata = FileSystemReader(path).read_metadata()
    mapping = metadata.planner_data or {}
    shapes: dict[str, tuple[int, ...]] = {}
    for flat_key, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        route = mapping.get(flat_key, tuple(flat_key.split(".", 1)))
        if len(route) == 2 and route[0] == prefix:
            shapes[str(route[1])] = tuple(int(s) for s in meta.size)
    return shapes


def load_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    state_dict_type: StateDictType | None = None,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` (and ``optimizer``).

    Collective: every rank must call it. Works for both types, at any world size and on any
    mesh: every rank reads only the slices of its own shards (DCP resharding). Pass
    ``state_dict_type`` to insist on one type (:class:`CheckpointError` on the other).

    Model keys and shapes are checked against the checkpoint first: a mismatch raises
    :class:`StateDictMismatchError` listing them, before anything is loaded. A saved tensor whose
    dtype differs from the destination's is cast on load (the destination keeps its dtype).
    Returns the checkpoint's metadata (``step``, ``state_dict_type``, ``world_size``, ...).
    """
    if state_dict_type is not None:
        _check_type(state_dict_type)
    error: BaseException | None = None
    meta: dict[str, Any] = {}
    path = Path(checkpoint_dir)
    try:
        path = _resolve(path.absolute())
        meta = _read_metadata(path)
        if state_dict_type is not None and meta["state_dict_type"] != state_dict_type:
            raise CheckpointError(
                f"checkpoint '{path}' is a {meta['state_dict_type']!r} checkpoint, but "
                f"state_dict_type={state_dict_type!r} was requested; pass "
                f"state_dict_type={meta['state_dict_type']!r} (or None to accept either)"
            )
        if optimizer is not None and not meta["has_optimizer"]:
            raise CheckpointError(
                f"checkpoint '{path}' has no optimizer state, but an optimizer was passed; pass "
                "optimizer=None, or save with save_checkpoint(..., optimizer=...)"
            )
        destination = {k: _shape(v) for k, v in _template(model).items()}
        error = _mismatch_error(
            f"checkpoint '{path}'", destination, _checkpoint_shapes(path, _MODEL)
        )
    except CheckpointError as exc:
        error = exc
    _raise_collectively(error, local_only=False)

    state = _sharded_state(model, optimizer)
    dcp_load(state, checkpoint_id=path)
    if optimizer is None:
        set_model_state_dict(model, state[_MODEL])
    else:
        set_state_dict(
            model, optimizer, model_state_dict=state[_MODEL], optim_state_dict=state[_OPTIM]
        )
    rank, _ = _rank_world()
    if rank == 0:
        kind, step = meta["state_dict_type"], meta["step"]
        logger.info("loaded %s checkpoint (step %s) from %s", kind, step, path)
    return meta


# --------------------------------------------------------------------------- safetensors


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
    (``pip install 'fsdp-precision[hf]'``).
    """
    if not isinstance(source, (nn.Module, str, os.PathLike)):
        raise CheckpointError(
            f"export_safetensors source is a {type(source).__name__}; pass an nn.Module or the "
            "directory of a checkpoint written by save_checkpoint()"
        )
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise CheckpointError(
            "export_safetensors needs the safetensors package, which is not installed; "
            "pip install 'fsdp-precision[hf]' (or pip install safetensors)"
        ) from exc

    out = Path(out_dir)
    weights = out / "model.safetensors"
    if isinstance(source, nn.Module):
        state = model_state_dict(source, "full")
        rank, _ = _rank_world()
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            _save_tensors(save_file, state, weights)
            config = getattr(source, "config", None)
            if config is not None and hasattr(config, "save_pretrained"):
                config.save_pretrained(out)
        _barrier()
        return weights
    path = _resolve(Path(source).absolute())
    _read_metadata(path)
    shapes = _checkpoint_shapes(path, _MODEL)
    metadata = FileSystemReader(path).read_metadata()
    mapping = metadata.planner_data or {}
    template: dict[str, Any] = {}
    for flat_key, meta in metadata.state_dict_metadata.items():
        route = mapping.get(flat_key, tuple(flat_key.split(".", 1)))
        if isinstance(meta, TensorStorageMetadata) and len(route) == 2 and route[0] == _MODEL:
            key = str(route[1])
            template[key] = torch.empty(shapes[key], dtype=meta.properties.dtype)
    with _single_process():
        dcp_load({_MODEL: template}, checkpoint_id=path, no_dist=True)
    out.mkdir(parents=True, exist_ok=True)
    _save_tensors(save_file, template, weights)
    if (path / "config.json").is_file():
        shutil.copyfile(path / "config.json", out / "config.json")
    return weights


def _save_tensors(save_file: Any, state: Mapping[str, Any], weights: Path) -> None:
    tensors = {k: v.contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
    partial = weights.with_name(f".{weights.name}.partial")
    save_file(tensors, str(partial), metadata={"format": "pt"})
    os.replace(partial, weights)
