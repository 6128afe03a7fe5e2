"""Crafted checkpoint files, each with a live payload: unpickled the way torch itself unpickles
it (plain ``pickle``), it creates a sentinel file. Shared by the hostile-input suites."""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


class Payload:
    """Unpickled by a plain unpickler, it runs a shell command creating ``sentinel``."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.sentinel}",))


def metadata_of(path: Path) -> Any:
    from fsdp_precision._trust.unpickle import load_metadata

    return load_metadata(path / ".metadata")


def crafted_metadata(path: Path, sentinel: Path) -> None:
    (path / ".metadata").write_bytes(pickle.dumps(Payload(sentinel)))


def crafted_byte_item(path: Path, sentinel: Path) -> None:
    """The learning rate, stored as a byte item, replaced by a payload appended to a data file
    (the metadata, rewritten with DCP's own records only, points to it)."""
    metadata = metadata_of(path)
    key = next(k for k in metadata.storage_data if k.fqn.endswith("param_groups.0.lr"))
    info = metadata.storage_data[key]
    data = path / info.relative_path
    buffer = io.BytesIO()
    torch.save(Payload(sentinel), buffer)
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(buffer.getvalue())
    metadata.storage_data[key] = type(info)(info.relative_path, offset, len(buffer.getvalue()))
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


def escaping_path(path: Path, sentinel: Path) -> None:
    metadata = metadata_of(path)
    key, info = next(iter(metadata.storage_data.items()))
    metadata.storage_data[key] = type(info)("../outside.distcp", info.offset, info.length)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


CRAFTED: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "metadata": (crafted_metadata, r"asks to construct posix\.system, which is not DCP"),
    "byte item": (crafted_byte_item, r"param_groups\.0\.lr' holds an object that only "),
    "escaping path": (escaping_path, r"names the data file '\.\./outside\.distcp', which is not"),
}
