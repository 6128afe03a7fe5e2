"""A training run's checkpoints in one directory: one per saved step, the last few kept, and
the resume after a restart.

>>> meta = resume_from_latest("ckpt", model, optimizer)            # doctest: +SKIP
>>> start = meta["step"] + 1 if meta else 0                         # doctest: +SKIP
>>> for step in range(start, steps):                                # doctest: +SKIP
...     train_one_step(step)
...     save_step("ckpt", model, optimizer, step=step, keep_last=2)

Each save is :func:`save_checkpoint` into ``<root>/step-<step>`` (atomic); then rank 0 deletes
the complete step checkpoints beyond the newest ``keep_last``, and what interrupted saves of
older steps left behind. A save killed midway leaves its step incomplete, so
:func:`latest_checkpoint` (and the resume) takes the step before. Under ``torchrun
--max-restarts N`` a group whose rank died restarts every rank, and the loop above continues from
the newest complete step: see ``docs/guides/distributed.md`` (elastic resume).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fsdp_precision._base.errors import CheckpointError
from fsdp_precision._edges.checkpoint.atomic import is_own_leftover, recover
from fsdp_precision._edges.checkpoint.collective import barrier, from_rank0, rank_world
from fsdp_precision._edges.checkpoint.metadata import dcp_metadata, read_metadata
from fsdp_precision._edges.checkpoint.save_load import load_checkpoint, save_checkpoint
from fsdp_precision._edges.checkpoint.state import StateDictType
from fsdp_precision._trust.reader import check_files

__all__ = ["latest_checkpoint", "resume_from_latest", "save_step", "step_checkpoints"]

logger = logging.getLogger(__name__)

_STEP = re.compile(r"step-(\d+)")


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:09d}"


def step_checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """The complete step checkpoints under ``root``, oldest first, as ``(step, path)``. Local:
    no collective."""
    path = Path(root)
    if not path.is_dir():
        return []
    found: list[tuple[int, Path]] = []
    for child in path.iterdir():
        match = _STEP.fullmatch(child.name)
        if match is None:
            continue
        if child.is_symlink():  # a step is a directory of the root, not a way out of it
            logger.warning("skipping %s: a symbolic link, not a checkpoint of %s", child, path)
            continue
        try:
            read_metadata(recover(child))
        except CheckpointError:
            continue
        found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest step checkpoint under ``root`` that passes every check a load makes first
    (its marker's fields, DCP's metadata read as data, every data file there with its bytes),
    or ``None``. A newer step that fails them is skipped with a warning. Local: no collective."""
    return _newest_loadable(root)[0]


def _newest_loadable(
    root: str | os.PathLike[str],
) -> tuple[Path | None, list[tuple[Path, CheckpointError]]]:
    """The newest loadable step, and the newer ones skipped with why."""
    skipped: list[tuple[Path, CheckpointError]] = []
    for _, path in reversed(step_checkpoints(root)):
        try:
            checked = recover(path)
            read_metadata(checked)
            check_files(checked, dcp_metadata(checked))
        except CheckpointError as err:
            logger.warning("skipping step checkpoint %s: %s", path, err)
            skipped.append((path, err))
            continue
        return path, skipped
    return None, skipped


def save_step(
    root: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int,
    keep_last: int = 2,
    state_dict_type: StateDictType = "sharded",
    extra: Mapping[str, Any] | None = None,
    checksums: bool = True,
) -> Path:
    """Save step ``step`` into ``<root>/step-<step>`` (collective, atomic, with checksums unless
    ``checksums=False``: see :func:`save_checkpoint`), then keep only the newest ``keep_last``
    complete step checkpoints (rank 0 deletes the others). Returns the new checkpoint's path.

    Raises :class:`CheckpointError` for a ``step`` or ``keep_last`` that is not a non-negative
    integer (``keep_last`` at least 1), before anything is written.
    """
    for name, value, least in (("step", step, 0), ("keep_last", keep_last, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise CheckpointError(f"{name}={value!r}; pass an integer >= {least}")
    target = save_checkpoint(
        _step_dir(Path(root), step),
        model,
        optimizer,
        state_dict_type=state_dict_type,
        step=step,
        extra=extra,
        checksums=checksums,
    )
    rank, _ = rank_world()
    if rank == 0:
        _prune(Path(root), keep_last)
    barrier()
    return target


def _prune(root: Path, keep_last: int) -> None:
    """Delete the complete step checkpoints older than the newest ``keep_last``, and what
    interrupted saves of older steps left (``step-<N>.tmp-<id>``, ``.old-<id>``): only
    directories this library names so, never ``step-<N>.hf`` or anything else beside them."""
    complete = step_checkpoints(root)
    for _, path in complete[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)
    if not complete:
        return
    newest = complete[-1][0]
    for child in root.iterdir():
        target = is_own_leftover(child)
        match = _STEP.fullmatch(target) if target is not None else None
        if match is not None and int(match.group(1)) < newest:
            shutil.rmtree(child, ignore_errors=True)


def resume_from_latest(
    root: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any] | None:
    """Load the newest loadable step checkpoint under ``root`` into ``model`` (and
    ``optimizer``) and return its metadata (``step``, ``extra``, ...); ``None`` when there is
    none (a first start). Collective: rank 0 chooses the checkpoint, every rank loads it.

    A newer step that fails the checks a load makes first (a damaged, truncated or crafted
    one) is skipped with a warning, and the newest one that passes is loaded. When there are
    step checkpoints and none passes, the newest one's error is raised on every rank: a run
    never starts afresh over checkpoints it could not read."""
    chosen: Path | None = None
    error: CheckpointError | None = None
    if rank_world()[0] == 0:
        chosen, skipped = _newest_loadable(root)
        if chosen is None and skipped:
            error = skipped[0][1]
    chosen, error = from_rank0((chosen, error))
    if error is not None:
        raise error
    if chosen is None:
        return None
    meta = load_checkpoint(chosen, model, optimizer)
    logger.info("resumed from %s (step %s)", chosen, meta.get("step"))
    return meta
