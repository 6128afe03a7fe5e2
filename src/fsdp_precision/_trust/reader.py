"""DCP's reader and planner, with everything they unpickle read as data only; and the checks of
a checkpoint's files that run before anything is loaded.

:class:`TrustedReader` reads ``.metadata`` through the allow-list; :class:`TrustedLoadPlanner`
checks every byte item with ``torch.load(weights_only=True)`` before DCP's own planner places it
(the bytes checked are the bytes placed). :func:`check_files` reads ahead what a load will need:
every data file ``.metadata`` names exists, inside the directory, with the bytes its entries
span, and every byte item reads as data; so a damaged or crafted checkpoint is refused with the
model and optimizer untouched.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from fsdp_precision._base.errors import CheckpointReadError
from fsdp_precision._trust.unpickle import check_relative_path, load_byte_item, load_metadata

__all__ = ["METADATA_NAME", "TrustedLoadPlanner", "TrustedReader", "check_files", "trusted_load"]

#: The file DCP writes its metadata to.
METADATA_NAME = ".metadata"


class TrustedReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read through the allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        metadata = load_metadata(Path(self.path) / METADATA_NAME)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as torch's reader does
        return metadata


class TrustedLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that places a byte item only once it read as data."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        data = value.read()
        load_byte_item(data, f"the stored value {read_item.dest_index.fqn!r}")
        super().load_bytes(read_item, io.BytesIO(data))


def trusted_load(state: dict[str, Any], path: Path, *, no_dist: bool = False) -> None:
    """DCP's load of ``state`` from ``path`` with the trusted reader and planner."""
    dcp_load(
        state,
        checkpoint_id=path,
        no_dist=no_dist,
        storage_reader=TrustedReader(path),
        planner=TrustedLoadPlanner(),
    )


def check_files(path: Path, metadata: Any) -> None:
    """Before a load: every data file of ``metadata`` is a plain name inside ``path``, exists and
    holds the bytes its entries span, and every byte item reads as data.

    Raises :class:`CheckpointReadError` (a missing or short file) or
    :class:`UnsafeCheckpointError` (a name outside the directory, an item only code could
    rebuild) naming the file."""
    storage: dict[Any, Any] = dict(metadata.storage_data or {})
    needed: dict[str, int] = {}
    for info in storage.values():
        name = check_relative_path(info.relative_path, path)
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    for name, size in sorted(needed.items()):
        file = path / name
        try:
            have = file.stat().st_size if file.is_file() else -1
        except OSError:
            have = -1
        if have < 0:
            raise CheckpointReadError(
                f"checkpoint '{path}' lacks its data file '{name}'; nothing was loaded: load an "
                "earlier checkpoint, or copy the whole directory again"
            )
        if have < size:
            raise CheckpointReadError(
                f"checkpoint '{path}': data file '{name}' holds {have} bytes, its metadata needs "
                f"{size} (a truncated copy or an interrupted write); nothing was loaded: load an "
                "earlier checkpoint, or copy the whole directory again"
            )
    for fqn, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, BytesStorageMetadata):
            continue
        info = storage.get(MetadataIndex(fqn))
        if info is None:
            raise CheckpointReadError(
                f"checkpoint '{path}' lists the stored value {fqn!r} but no file holds it; "
                "nothing was loaded: load an earlier checkpoint"
            )
        with open(path / info.relative_path, "rb") as f:
            f.seek(int(info.offset))
            data = f.read(int(info.length))
        load_byte_item(data, f"checkpoint '{path}': the stored value {fqn!r}")
