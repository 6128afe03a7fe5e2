"""A checkpoint's checksums, collectively: each rank hashes a share of the files at save (after
every rank wrote) and verifies a share before a load; rank 0 records them in the marker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from fsdp_precision._base.devices import rank_device
from fsdp_precision._base.errors import CheckpointError, CheckpointReadError, CheckpointWriteError
from fsdp_precision._edges.checkpoint.atomic import METADATA_FILE
from fsdp_precision._edges.checkpoint.collective import distributed, rank_world
from fsdp_precision._trust.checksums import ALGORITHM, digest, verify

__all__ = ["record_checksums", "verify_checksums"]


def _share(names: list[str]) -> list[str]:
    rank, world = rank_world()
    return names[rank::world]


def record_checksums(directory: Path) -> tuple[dict[str, Any] | None, CheckpointError | None]:
    """Collective: ``({"algorithm", "files": {name: digest}}, None)`` for every file of
    ``directory`` but the marker, each rank hashing a share; ``(None, error)`` on every rank
    when some rank could not read its share."""
    names = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != METADATA_FILE)
    found: dict[str, str] = {}
    error: CheckpointError | None = None
    try:
        found = {name: digest(directory / name) for name in _share(names)}
    except OSError as err:
        error = CheckpointWriteError(
            f"cannot read back '{directory}' to record its checksums ({err!r}); the previous "
            "checkpoint (if any) is unchanged: check the filesystem and save again"
        )
    parts: list[Any] = [(found, error)]
    if distributed():
        parts = [None] * dist.get_world_size()
        rank_device()  # NCCL sends objects through the current device: this rank's (LOCAL_RANK)
        dist.all_gather_object(parts, (found, error))
    files: dict[str, str] = {}
    for part_found, part_error in parts:
        if part_error is not None:
            return None, part_error
        files.update(part_found)
    return {"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}, None


def verify_checksums(
    recorded: object, through: Path, shown: Path, *, collective: bool = True
) -> CheckpointError | None:
    """This rank's share (or, not ``collective``, every file) of the recorded checksums checked
    in the directory reached through ``through``; the error, or None. A checkpoint saved with
    ``checksums=False`` records none: nothing to check."""
    if recorded is None:
        return None
    if (
        not isinstance(recorded, dict)
        or recorded.get("algorithm") != ALGORITHM
        or not isinstance(recorded.get("files"), dict)
        or not all(isinstance(v, str) for v in recorded["files"].values())
    ):
        return CheckpointReadError(
            f"checkpoint '{shown}' records checksums this release does not read "
            f"({str(recorded)[:80]}); its marker is damaged or foreign: load an earlier one"
        )
    expected: dict[str, str] = recorded["files"]
    names = sorted(expected)
    present = {p.name for p in through.iterdir() if p.is_file()}
    unlisted = sorted(n for n in present - set(names) if n != METADATA_FILE)
    if unlisted:  # a file the save never wrote: foreign, or another save's
        return CheckpointReadError(
            f"checkpoint '{shown}' holds files its save did not write ({unlisted[:3]}); nothing "
            "was loaded: load an earlier checkpoint, or save this one again"
        )
    try:
        verify(through, expected, _share(names) if collective else names, shown)
    except CheckpointError as err:
        return err
    return None
