"""Checking a checkpoint another framework will load: accelerate's ``save_state``, torchtitan's
``step-N``, a plain ``torch.distributed.checkpoint`` directory.

Those frameworks call DCP with its default reader and planner, which unpickle ``.metadata`` and
every stored value (an optimizer's ``param_groups``) with plain ``pickle``: a crafted file runs
code. The library cannot hand them its reader without patching them, so it offers the same checks
its own loads make, to run first: every DCP directory at or under the path, read as data only.
"""

from __future__ import annotations

import os
from pathlib import Path

from fsdp_precision._base.errors import CheckpointNotFoundError
from fsdp_precision._edges.checkpoint.atomic import METADATA_FILE
from fsdp_precision._edges.checkpoint.integrity import verify_checksums
from fsdp_precision._edges.checkpoint.metadata import dcp_metadata, read_metadata
from fsdp_precision._trust.reader import METADATA_NAME, check_files

__all__ = ["check_checkpoint"]


def _dcp_directories(root: Path) -> list[Path]:
    """Every directory at or under ``root`` holding DCP's ``.metadata``; symlinked directories
    are not followed (a checkpoint that links out of itself is not checked through the link)."""
    found = []
    for directory, subdirectories, files in os.walk(root, followlinks=False):
        subdirectories.sort()
        if METADATA_NAME in files:
            found.append(Path(directory))
    return found


def check_checkpoint(path: str | os.PathLike[str]) -> tuple[Path, ...]:
    """Check every ``torch.distributed.checkpoint`` directory at or under ``path`` the way the
    library's own loads do, before a framework loads it; return the directories checked.

    For checkpoints the library does not load itself: ``accelerator.load_state(dir)`` (DCP
    directories ``pytorch_model_fsdp_0``, ``optimizer_0``), torchtitan's ``step-N``. Each
    directory's ``.metadata`` is read through an allow-list of DCP's classes, its data files
    must be plain names inside it holding the bytes the metadata spans, and every stored value
    must read with ``torch.load(weights_only=True)``; a directory the library saved also has its
    checksums verified. Local (no collective): call it on every rank, or on one before a
    barrier. The framework then reads the files again: checking guards against a file that was
    crafted or damaged before the call, not against one swapped in between.

    Raises :class:`UnsafeCheckpointError` for a file only code could read (nothing of it ran),
    :class:`CheckpointReadError` for a missing, short or altered file, and
    :class:`CheckpointNotFoundError` when ``path`` holds no DCP directory.
    """
    root = Path(path).absolute()
    if not root.is_dir():
        raise CheckpointNotFoundError(
            f"check_checkpoint('{root}'): not a directory; pass the directory a framework saved "
            "(accelerate's save_state output, torchtitan's step-N)"
        )
    directories = _dcp_directories(root)
    if not directories:
        raise CheckpointNotFoundError(
            f"check_checkpoint('{root}'): no torch.distributed.checkpoint directory (no "
            f"{METADATA_NAME}) at or under it; pass the directory a framework saved"
        )
    for directory in directories:
        check_files(directory, dcp_metadata(directory))
        if (directory / METADATA_FILE).is_file():  # the library's own: its checksums too
            meta = read_metadata(directory)
            error = verify_checksums(meta.get("checksums"), directory, directory, collective=False)
            if error is not None:
                raise error
    return tuple(directories)
