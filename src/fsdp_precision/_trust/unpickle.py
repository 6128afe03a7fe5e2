"""Reading a checkpoint's pickled parts without running anything they contain.

torch's DCP writes its ``.metadata`` with ``pickle.dump`` and reads it with ``pickle.load``, and
stores non-tensor values (an optimizer's ``param_groups``) as byte items its default planner
reads with ``torch.load(weights_only=False)``: a crafted file runs code on load. Here the
metadata goes through an unpickler that resolves only an allow-list of globals (DCP's metadata
records, ``torch.Size``, dtypes, layouts, memory formats, paths), and byte items through
``torch.load(weights_only=True)`` (numbers, strings, containers, tensors). Anything else raises
:class:`UnsafeCheckpointError` naming what was found, before it is constructed.
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fsdp_precision._base.errors import CheckpointReadError, UnsafeCheckpointError

__all__ = ["ALLOWED_METADATA_GLOBALS", "check_relative_path", "load_byte_item", "load_metadata"]

_TORCH_VALUES = (
    # dtypes (those this torch has are looked up; the others never match)
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz",
    "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "complex128",
    "complex64", "complex32", "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32",
    "uint64", "bool", "qint8", "quint8", "qint32",
    # layouts and memory formats
    "strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn",
    "jagged", "contiguous_format", "channels_last", "channels_last_3d", "preserve_format",
)  # fmt: skip

#: Module -> the names a DCP ``.metadata`` may resolve there (torch 2.11 to 2.15).
ALLOWED_METADATA_GLOBALS: Mapping[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size", *_TORCH_VALUES}),
    "pathlib": frozenset({"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"}),
    "collections": frozenset({"OrderedDict"}),
}


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, where: Path) -> None:
        super().__init__(file)
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED_METADATA_GLOBALS.get(module, ()):
            found = super().find_class(module, name)
            if (
                module != "torch"
                or isinstance(found, (torch.dtype, torch.layout, torch.memory_format))
                or found is torch.Size
            ):
                return found
        raise UnsafeCheckpointError(
            f"'{self._where}' asks to construct {module}.{name}, which is not DCP checkpoint "
            "metadata: it holds something other than tensors and metadata (a crafted or foreign "
            "file), and nothing of it was run or loaded. Load a checkpoint from a source you "
            "trust, or save it again"
        )


def load_metadata(path: Path) -> Any:
    """DCP's ``Metadata`` from the file ``path`` (``<checkpoint>/.metadata``), its globals
    resolved only from the allow-list, and every ``relative_path`` a plain file name.

    Raises :class:`UnsafeCheckpointError` for anything outside the allow-list and
    :class:`CheckpointReadError` for a missing or damaged file."""
    try:
        with open(path, "rb") as f:
            metadata = _AllowListUnpickler(f, path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure to unpickle means a damaged file
        raise CheckpointReadError(
            f"cannot read the DCP metadata '{path}' ({err!r}); the checkpoint is damaged or was "
            "not written by torch.distributed.checkpoint: load an earlier one, or save it again"
        ) from err
    from torch.distributed.checkpoint.metadata import Metadata  # lazy: torch's DCP records

    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(
            f"'{path}' holds a {type(metadata).__name__}, not DCP metadata; nothing was loaded"
        )
    for info in (metadata.storage_data or {}).values():
        check_relative_path(getattr(info, "relative_path", None), path.parent)
        if getattr(info, "transform_descriptors", None):  # an extension would run on load
            raise UnsafeCheckpointError(
                f"'{path}' asks for load transforms {info.transform_descriptors!r}; "
                "fsdp_precision writes none and reads none; nothing was loaded"
            )
    return metadata


_PLAIN = re.compile(r"^[A-Za-z0-9_.\-]+$")


def check_relative_path(name: object, directory: Path) -> str:
    """``name`` if it is a plain file name inside ``directory`` (no separator, not ``..``);
    :class:`UnsafeCheckpointError` else."""
    if not isinstance(name, str) or not _PLAIN.match(name) or name in (".", ".."):
        raise UnsafeCheckpointError(
            f"checkpoint '{directory}' names the data file {name!r}, which is not a plain file "
            "name inside its directory; nothing was loaded"
        )
    return name


def load_byte_item(data: bytes, what: str) -> Any:
    """A DCP byte item (a pickled non-tensor value) read with ``weights_only=True``."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(
            f"{what} holds an object that only code could rebuild ({err}); fsdp_precision reads "
            "stored values as data only (numbers, strings, containers, tensors), and nothing of "
            "it was run. An optimizer or scheduler that stores other objects cannot be resumed "
            "from a checkpoint this library reads; save such state yourself"
        ) from err
    except Exception as err:  # noqa: BLE001 - truncated or corrupted bytes
        raise CheckpointReadError(
            f"{what} is damaged ({err!r}); load an earlier checkpoint"
        ) from err
