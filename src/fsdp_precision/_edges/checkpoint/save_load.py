"""Checkpoints on disk: a collective, atomic save and a validated, resharding load (DCP)."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from fsdp_precision._base.errors import CheckpointError, CheckpointReadError, CheckpointWriteError
from fsdp_precision._edges.checkpoint import metadata as _metadata
from fsdp_precision._edges.checkpoint.atomic import prepare_target, recover, swap_into_place
from fsdp_precision._edges.checkpoint.collective import (
    CheckpointException,
    describe,
    from_rank0,
    raise_collectively,
    rank_world,
    single_process,
)
from fsdp_precision._edges.checkpoint.integrity import record_checksums, verify_checksums
from fsdp_precision._edges.checkpoint.metadata import (
    MODEL,
    OPTIM,
    dcp_metadata,
    read_metadata,
    saved_tensors,
)
from fsdp_precision._edges.checkpoint.state import (
    StateDictType,
    check_type,
    mismatch_error,
    model_shapes,
)
from fsdp_precision._edges.entries import strip_wrappers
from fsdp_precision._edges.layouts import layout_for
from fsdp_precision._edges.record import precision_record
from fsdp_precision._trust.checksums import pinned, same_directory
from fsdp_precision._trust.reader import check_files, trusted_load

__all__ = ["load_checkpoint", "save_checkpoint"]

logger = logging.getLogger(__name__)


def save_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    state_dict_type: StateDictType = "sharded",
    step: int | None = None,
    extra: Mapping[str, Any] | None = None,
    checksums: bool = True,
) -> Path:
    """Save ``model`` (and ``optimizer``) to ``checkpoint_dir`` atomically; return the path.

    Collective: every rank must call it with the same arguments. The directory must be on a
    filesystem every rank can see.

    - ``"sharded"``: every rank writes its own shards (``torch.distributed.checkpoint.save``);
      loadable at another world size and another mesh (FSDP 1-D <-> HSDP 2-D).
    - ``"full"``: the state is consolidated on rank 0, which alone writes it (also DCP format,
      loadable in the same ways; exportable with :func:`export_safetensors`).

    Atomic: everything is written into the sibling ``<dir>.tmp-<id>``; after every rank has
    written, rank 0 renames the previous checkpoint to ``<dir>.old-<id>``, the new one to
    ``<dir>``, and deletes the old one. A crash at any point leaves the previous or the new
    checkpoint loadable, never a partial one. Metadata (step, type, world size, torch and library
    versions, the model's kept tensors and boundary casts, and ``extra``: rank 0's
    JSON-serialisable data, e.g. the loss history) goes to ``METADATA_FILE``, written last. A
    transformers or Diffusers model also gets its ``config.json``, so that
    :func:`export_safetensors` can lay the checkpoint out offline. ``checksums``: the marker
    records every file's checksum (XXH3-128, each rank hashing a share), verified before any
    load; ``False`` skips them for very large checkpoints (the cost:
    ``benchmarks/bench_checkpoint.py``).

    Raises :class:`CheckpointError` for a bad ``state_dict_type`` or ``step``, and
    :class:`CheckpointWriteError` on every rank when anything cannot be written, or when
    ``checkpoint_dir`` exists and is neither empty nor a checkpoint; the previous checkpoint
    stays in place.
    """
    kind = check_type(state_dict_type)
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise CheckpointError(
            f"step={step!r} is not an int; pass the training step as an int, or None"
        )
    _metadata.check_extra(extra)
    rank, world = rank_world()
    target = Path(checkpoint_dir).absolute()
    tmp: Path | None = None
    error: CheckpointError | None = None
    if rank == 0:
        try:
            tmp = prepare_target(target)
        except CheckpointError as err:
            error = err
    tmp, error = from_rank0((tmp, error))
    if error is not None:
        raise error
    tmp = cast(Path, tmp)

    error, stateless = _write_state(tmp, model, optimizer, kind)
    layout = layout_for(model)
    if rank == 0 and error is None:
        try:
            base = model.get_base_model() if layout.name == "peft" else model  # type: ignore[operator]
            layout_for(base).save_config(tmp, None)  # the model's config, for offline exports
        except Exception as err:  # noqa: BLE001 - raised on every rank below
            error = _write_error(f"cannot write the config into '{tmp}' ({err!r})", err)
    _cleanup_on_error(error, tmp)  # also the barrier: every rank's shards are written
    sums: dict[str, Any] | None = None
    if checksums:
        sums, error = record_checksums(tmp)
        _cleanup_on_error(error, tmp)
    if rank == 0:
        try:
            _metadata.write_metadata(
                tmp,
                kind,
                step,
                world,
                has_optimizer=optimizer is not None,
                extra=extra,
                precision=precision_record(model, layout.name),
                optimizer_stateless=stateless,
                checksums=sums,
            )
        except Exception as err:  # noqa: BLE001 - raised on every rank below
            error = _write_error(f"cannot finish checkpoint '{tmp}' ({err!r})", err)
    _cleanup_on_error(error, tmp)
    if rank == 0:
        try:
            swap_into_place(tmp, target)
        except CheckpointWriteError as err:
            error = err
    error = from_rank0(error)
    if error is not None:
        raise error
    if rank == 0:
        logger.info("saved %s checkpoint (step %s) to %s", kind, step, target)
    return target


def _checked(
    path: Path,
    through: Path,
    inode: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state_dict_type: StateDictType | None,
) -> tuple[dict[str, Any], CheckpointError | None]:
    """What a load checks before it touches anything: the marker, the request, the keys and
    shapes, every data file and stored value, this rank's share of the checksums (through the
    pinned directory), and that no save replaced the directory meanwhile."""
    meta: dict[str, Any] = {}
    try:
        meta = read_metadata(path)
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
        saved = {k: shape for k, (shape, _) in saved_tensors(path, MODEL).items()}
        mismatch = mismatch_error(f"checkpoint '{path}'", model_shapes(model), saved)
        if mismatch is not None:
            return meta, mismatch
        check_files(path, dcp_metadata(path))  # every file there, every stored value data
        replaced = CheckpointReadError(
            f"checkpoint '{path}' was replaced while it was being checked (a save to the same "
            "directory); nothing was loaded: load it again"
        )
        if not same_directory(path, inode):
            return meta, replaced
        error = verify_checksums(meta.get("checksums"), through, path)
        if not same_directory(path, inode):
            return meta, replaced
        return meta, error
    except CheckpointError as exc:
        return meta, exc


def _read_into(
    through: Path,
    path: Path,
    meta: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> None:
    """Every rank: the checked checkpoint, read through the pinned directory, into the model."""
    state = _sharded_state(model, optimizer)
    stateless = list(meta.get("optimizer_stateless", ()))
    if optimizer is not None:  # saved without state: restored without state, as it was
        for fqn in stateless:
            state[OPTIM]["state"].pop(fqn, None)
    try:
        trusted_load(state, through)
    except (OSError, CheckpointException) as err:
        raise CheckpointReadError(
            f"cannot read checkpoint '{path}' ({describe(err)}); a file of the checkpoint is "
            "missing or damaged, or the optimizer does not match the saved one. The model and "
            "optimizer may be partly loaded: build them afresh, then load an earlier checkpoint "
            "(or the matching optimizer)"
        ) from err
    if optimizer is None:
        set_model_state_dict(model, state[MODEL])
        return
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state[MODEL],
        optim_state_dict=state[OPTIM],
        # the model's keys were checked above; stateless parameters have no entry
        options=StateDictOptions(strict=not stateless),
    )
    _drop_state(model, optimizer, stateless)


def _cleanup_on_error(error: CheckpointError | None, tmp: Path) -> None:
    """Raise the first rank's error on every rank, rank 0 removing its own partial directory
    first (a full disk does not stay full)."""
    try:
        raise_collectively(error)
    except CheckpointError:
        if rank_world()[0] == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_error(what: str, cause: BaseException) -> CheckpointWriteError:
    error = CheckpointWriteError(
        f"{what}; the previous checkpoint (if any) is unchanged: check that the directory is "
        "writable and has free space, and save again"
    )
    error.__cause__ = cause
    return error


def _write_state(
    tmp: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, kind: StateDictType
) -> tuple[CheckpointWriteError | None, list[str]]:
    """Every rank: write the state into ``tmp`` (DCP raises a write failure on every rank for
    ``"sharded"``; for ``"full"`` only rank 0 writes, and only rank 0 can fail). Also returns
    the parameters the optimizer holds no state for (no gradient yet: an expert no token
    reached, an unused head), which a load must leave without state."""
    rank, _ = rank_world()
    if kind == "sharded":
        state = _sharded_state(model, optimizer)
    else:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        if optimizer is None:
            state = {MODEL: get_model_state_dict(model, options=options)}
        else:
            msd, osd = get_state_dict(model, optimizer, options=options)
            state = {MODEL: msd, OPTIM: osd}
    stateless = _stateless(state.get(OPTIM))
    try:
        if kind == "sharded":
            dcp_save(state, checkpoint_id=tmp)
        elif rank == 0:
            with single_process():
                dcp_save(state, checkpoint_id=tmp, no_dist=True)
    except (OSError, CheckpointException) as err:
        return _write_error(f"cannot write checkpoint '{tmp}' ({describe(err)})", err), stateless
    return None, stateless


def _drop_state(model: nn.Module, optimizer: torch.optim.Optimizer, fqns: list[str]) -> None:
    """Remove the state loading gave the parameters saved without one (DCP initialises every
    parameter's state before it loads), so the next step treats them as the saved run did."""
    if not fqns:
        return
    wanted = set(fqns)
    for name, param in model.named_parameters():
        if strip_wrappers(name) in wanted:
            optimizer.state.pop(param, None)


def _stateless(osd: Any) -> list[str]:
    """The parameters of an optimizer state dict (DCP's, keyed by FQN) that have no state."""
    if not isinstance(osd, dict) or not osd.get("param_groups"):
        return []
    state = osd.get("state", {})
    return sorted(f for g in osd["param_groups"] for f in g.get("params", ()) if f not in state)


def _sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {MODEL: get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {MODEL: msd, OPTIM: osd}


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

    Checked first, on every rank, before anything is loaded: a missing or incomplete checkpoint
    raises :class:`CheckpointNotFoundError`, corrupt metadata or a missing or truncated data
    file :class:`CheckpointReadError`, model keys and shapes that differ from the checkpoint's
    :class:`StateDictMismatchError` listing them, and anything that is not tensors and data (a
    crafted ``.metadata`` or stored value, a file outside the directory)
    :class:`UnsafeCheckpointError`: nothing a checkpoint holds is run (its pickled parts are read
    through an allow-list, stored values with ``weights_only=True``). A saved tensor whose dtype
    differs from the destination's is cast on load (the destination keeps its dtype). A DCP file
    that cannot be read while loading raises :class:`CheckpointReadError`; the model and
    optimizer may then be partly loaded. The checksums the save recorded are verified first
    (each rank a share), and the directory is read through a pinned handle: a save swapping a
    new checkpoint into the same path meanwhile is refused before anything is loaded, or does
    not reach the load (Linux), never mixed into it. Returns the checkpoint's metadata
    (``step``, ``state_dict_type``, ``world_size``, ...).
    """
    if state_dict_type is not None:
        check_type(state_dict_type)
    path = Path(checkpoint_dir).absolute()
    error: CheckpointError | None = None
    try:
        path = recover(path)
    except CheckpointError as exc:
        error = exc
    raise_collectively(error)
    with pinned(path) as (through, inode):
        meta, error = _checked(path, through, inode, model, optimizer, state_dict_type)
        raise_collectively(error)
        _read_into(through, path, meta, model, optimizer)
    rank, _ = rank_world()
    if rank == 0:
        kind, step = meta["state_dict_type"], meta["step"]
        logger.info("loaded %s checkpoint (step %s) from %s", kind, step, path)
    return meta
