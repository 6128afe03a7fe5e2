"""The on-disk protocol that makes saves atomic: a sibling temporary directory, a completion
marker written last, two renames, and the recovery of what an interrupted save left behind.

``save(dir)`` writes into ``dir.tmp-<id>``; the marker :data:`METADATA_FILE` is written last; then
``dir`` is renamed to ``dir.old-<id>``, ``dir.tmp-<id>`` to ``dir``, and ``dir.old-<id>`` deleted.
At every instant either ``dir`` is complete or (between the renames) both the previous and the new
checkpoint lie complete beside it. Rank 0 alone touches directories; every function here is local.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

from fsdp_precision._base.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReadError,
    CheckpointWriteError,
)

__all__ = [
    "METADATA_FILE",
    "is_own_leftover",
    "prepare_target",
    "recover",
    "swap_into_place",
    "write_json",
]

logger = logging.getLogger(__name__)

#: Written last into a checkpoint directory: its presence marks the checkpoint complete.
METADATA_FILE = "fsdp_precision_checkpoint.json"


#: What writes each kind of directory (for messages).
_VERBS = {"checkpoint": "save_checkpoint", "export": "export_safetensors"}


def _siblings(target: Path, tag: str) -> list[Path]:
    """The directories a save of ``target`` names ``<target>.<tag>-<12 hex>``: only those (a
    user's ``<target>.tmp-mine`` is not one)."""
    if not target.parent.is_dir():
        return []
    own = re.compile(re.escape(f"{target.name}.{tag}-") + r"[0-9a-f]{12}")
    try:
        return sorted(
            p
            for p in target.parent.iterdir()
            if own.fullmatch(p.name) and p.is_dir() and not p.is_symlink()
        )
    except OSError as err:
        raise CheckpointReadError(
            f"cannot list '{target.parent}' to look for what an interrupted save of '{target}' "
            f"left: {err}; make the directory readable"
        ) from err


def _complete(path: Path, marker: str = METADATA_FILE) -> bool:
    return (path / marker).is_file()


_LEFTOVER = re.compile(r"(?P<target>.+)\.(tmp|old)-[0-9a-f]{12}")


def is_own_leftover(path: Path) -> str | None:
    """The target name when ``path`` is a directory an interrupted save or export left
    (``<target>.tmp-<12 hex>`` / ``.old-<12 hex>``), else None."""
    match = _LEFTOVER.fullmatch(path.name)
    if match is None or not path.is_dir() or path.is_symlink():
        return None
    return match.group("target")


def recover(target: Path, marker: str = METADATA_FILE) -> Path:
    """``target``, or the complete copy an interrupted save left next to it.

    The save protocol can only leave ``target`` missing between its two renames; then both the
    previous checkpoint (``<dir>.old-<id>``) and the new one (``<dir>.tmp-<id>``, complete) exist.
    The new one is used. Raises :class:`CheckpointNotFoundError` when there is neither.
    ``marker``: the file whose presence marks a directory complete (an export's record).
    """
    if target.is_dir():
        return target
    if target.exists():
        raise CheckpointNotFoundError(
            f"checkpoint directory '{target}' is a file, not a directory; pass the directory "
            "given to save_checkpoint()"
        )
    for tag in ("tmp", "old"):
        complete = [p for p in _siblings(target, tag) if _complete(p, marker)]
        if complete:
            chosen = max(complete, key=lambda p: (p / marker).stat().st_mtime)
            logger.warning(
                "checkpoint %s is missing; using %s left complete by an interrupted save",
                target,
                chosen,
            )
            return chosen
    raise CheckpointNotFoundError(
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


def _refuse_foreign(target: Path, marker: str, what: str) -> None:
    """Refuse to replace (and so delete) a path this library did not write."""
    if target.is_dir() and not target.is_symlink():
        if _complete(target, marker) or not any(target.iterdir()):
            return
        reason = f"a non-empty directory without {marker}"
    else:
        reason = "a file" if target.is_file() else "not a directory"
    raise CheckpointWriteError(
        f"'{target}' exists and is not an fsdp_precision {what} ({reason}); {_VERBS[what]} "
        "replaces the directory it is given and will not delete one it did not write: pass a "
        f"new or empty directory, or remove '{target}' first"
    )


def prepare_target(target: Path, marker: str = METADATA_FILE, what: str = "checkpoint") -> Path:
    """Rank 0, before a save: finish or clean up what an interrupted save left behind, and create
    the new sibling ``<target>.tmp-<id>``; return it.

    Raises :class:`CheckpointWriteError` (nothing at ``target`` is touched) when the parent cannot
    be made, ``target`` is not a checkpoint, or the temporary directory cannot be created.
    """
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CheckpointWriteError(
            f"cannot create '{target.parent}', the parent of {what} '{target}': {err}; pass a "
            "directory whose parent is (or can be made) a writable directory"
        ) from err
    if target.exists() or target.is_symlink():
        _refuse_foreign(target, marker, what)
    try:
        if not target.exists():
            try:
                recovered: Path | None = recover(target, marker)
            except CheckpointError:
                recovered = None
            if recovered is not None:
                os.replace(recovered, target)
                logger.warning(
                    "moved %s, left by an interrupted save, back to %s", recovered, target
                )
        if target.exists():
            for stale in _siblings(target, "tmp") + _siblings(target, "old"):
                shutil.rmtree(stale, ignore_errors=True)
        tmp = target.with_name(f"{target.name}.tmp-{uuid.uuid4().hex[:12]}")
        tmp.mkdir()
    except OSError as err:
        raise CheckpointWriteError(
            f"cannot prepare {what} '{target}': {err}; pass a directory in a writable place "
            "with free space"
        ) from err
    return tmp


def swap_into_place(tmp: Path, target: Path) -> None:
    """Rank 0: make the complete ``tmp`` the checkpoint at ``target``.

    At every instant either ``target`` is a complete checkpoint, or (between the two renames) both
    the previous one and the new one exist complete beside it, which :func:`recover` and the next
    save recover. Raises :class:`CheckpointWriteError` when a rename fails.
    """
    old = target.with_name(target.name + ".old-" + tmp.name.rpartition(".tmp-")[2])
    try:
        if target.exists():
            os.replace(target, old)
        os.replace(tmp, target)
    except OSError as err:
        raise CheckpointWriteError(
            f"cannot move the new checkpoint '{tmp}' into place at '{target}': {err}; the "
            "previous checkpoint (if any) is still loadable from there; check the filesystem "
            "and save again"
        ) from err
    _fsync_dir(target.parent)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` atomically: a temporary name, fsync, rename, fsync.

    Raises ``OSError`` as the filesystem does (the caller names the checkpoint).
    """
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "w") as fh:
        json.dump(data, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(partial, path)
    _fsync_dir(path.parent)
