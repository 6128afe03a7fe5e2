"""What an engine started from the base checkpoint must keep: a declaration the trainer writes.

RL frameworks start their inference engine from the base Hugging Face checkpoint (often with
``load_format="dummy"``) and stream the trainer's weights in afterwards: no export record lies
beside the model, so nothing tells the engine that the routers train in fp32. The trainer writes
what it keeps once, before the engine starts (:func:`declare_kept`: the same names, dtypes and
boundary casts an export's record holds, without weights), and the launcher hands the file to
the engine through the engine's own channels:

- vLLM: ``additional_config={"fsdp_precision": "kept.json"}`` (``--additional-config`` of
  ``vllm serve``; part of vLLM's compile-cache key), or
- any engine: the environment variable :data:`KEPT_ENV` (``FSDP_PRECISION_KEPT=kept.json``).

The file is JSON (never code), read once per file version; :func:`resolve_kept` is the one place
an engine learns what is kept: the declaration where one is given, else the export record of the
model directory (a local path or a Hugging Face Hub id: the record is looked up in the Hub's
cache, fetched where the Hub is reachable). Given both, they must agree.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from fsdp_precision._base.dtypes import dtype_from_name, dtype_name
from fsdp_precision._base.errors import CheckpointReadError, EngineDtypeError
from fsdp_precision._edges.checkpoint.atomic import write_json
from fsdp_precision._edges.record import EXPORT_RECORD, casts_json, parse_casts
from fsdp_precision._engines.kept import EngineKept, kept_of_export, kept_of_stream

if TYPE_CHECKING:
    from fsdp_precision._edges.stream import WeightStream

__all__ = ["CONFIG_KEY", "KEPT_ENV", "declare_kept", "read_declaration", "resolve_kept"]

#: The environment variable naming a declaration file (or an export directory).
KEPT_ENV = "FSDP_PRECISION_KEPT"
#: The key of an engine's plugin configuration (vLLM's ``additional_config``) naming one.
CONFIG_KEY = "fsdp_precision"
logger = logging.getLogger(__name__)
_FORMAT = "fsdp_precision.kept"
_FORMAT_VERSION = 1


def declare_kept(model: nn.Module | WeightStream, path: str | os.PathLike[str]) -> Path:
    """Write what ``model`` keeps (an FSDP2-wrapped or plain model, or a
    :func:`~fsdp_precision.full_weights` stream of it) to ``path``, for an inference engine
    started from the base checkpoint: every kept tensor's Hugging Face checkpoint name and dtype,
    the bulk dtype and the boundary casts training runs the kept modules with. Local (gathers
    nothing; call it on one rank); written atomically. Returns the path.

    Raises :class:`~fsdp_precision.EngineDtypeError` where the model's weights do not carry
    Hugging Face checkpoint names (engines load those)."""
    from fsdp_precision._edges.stream import WeightStream, full_weights  # lazy: trainers only

    stream = model if isinstance(model, WeightStream) else full_weights(model)
    kept = kept_of_stream(stream)  # refuses a layout engines cannot load
    reasons = {m.name: str(m.kept) for m in stream.metadata if m.kept is not None}
    target = Path(path)
    document = {
        "format": _FORMAT,
        "format_version": _FORMAT_VERSION,
        "layout": stream.layout,
        "bulk": dtype_name(kept.bulk),
        "kept": {
            name: {"dtype": dtype_name(dtype), "reason": reasons[name]}
            for name, dtype in kept.tensors.items()
        },
        "casts": casts_json(kept.casts),
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    write_json(target, document)
    return target


def _parse(data: object, where: str) -> EngineKept:
    def bad(what: str) -> CheckpointReadError:
        return CheckpointReadError(
            f"'{where}' is not a declaration of kept tensors: {what}; write it with "
            "fsdp_precision.integrations.declare_kept(model, path)"
        )

    if not isinstance(data, Mapping) or data.get("format") != _FORMAT:
        raise bad(f"its format is not {_FORMAT!r}")
    if data.get("format_version") != _FORMAT_VERSION:
        raise bad(f"format_version {data.get('format_version')!r} is not {_FORMAT_VERSION}")
    if data.get("layout") != "transformers":
        raise bad(
            f"its layout is {data.get('layout')!r}; engines load Hugging Face checkpoint names "
            "(layout 'transformers')"
        )
    bulk = dtype_from_name(data.get("bulk"))
    kept = data.get("kept")
    if bulk is None or not isinstance(kept, Mapping):
        raise bad(f"its bulk is {data.get('bulk')!r} and its kept field {type(kept).__name__}")
    tensors: dict[str, torch.dtype] = {}
    for name, entry in kept.items():
        dtype = dtype_from_name(entry.get("dtype")) if isinstance(entry, Mapping) else None
        if not isinstance(name, str) or dtype is None:
            raise bad(f"kept entry {name!r} is {entry!r}")
        tensors[name] = dtype
    casts = parse_casts(data.get("casts", {}), where)
    return EngineKept(tensors=tensors, casts=casts, bulk=bulk, source=where)


_cache: dict[tuple[str, int, int], EngineKept] = {}


def read_declaration(source: str | os.PathLike[str] | Mapping[str, Any]) -> EngineKept:
    """What a declaration keeps: a file :func:`declare_kept` wrote, the document itself (a
    mapping, as a launcher may inline it in the engine's configuration), or an export directory
    (its record). Raises :class:`~fsdp_precision.CheckpointReadError` naming what is wrong."""
    if isinstance(source, Mapping):
        return _parse(source, "the declaration given inline")
    path = Path(source)
    if path.is_dir():
        kept = kept_of_export(path)
        if kept is None:
            raise CheckpointReadError(
                f"'{path}' holds no {EXPORT_RECORD}: declare what is kept with "
                "fsdp_precision.integrations.declare_kept(model, 'kept.json') and name that file"
            )
        return kept
    try:
        stat = path.stat()
        key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        if key not in _cache:
            _cache[key] = _parse(json.loads(path.read_text()), str(path))
        return _cache[key]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointReadError(
            f"cannot read the declaration of kept tensors '{path}': {err}; write it with "
            "fsdp_precision.integrations.declare_kept(model, path)"
        ) from err


def _hub_record(model: str, revision: str | None) -> Path | None:
    """The export record of a Hugging Face Hub id: from the Hub's cache, else fetched where the
    Hub is reachable; ``None`` where the repository holds none (or there is no Hub package)."""
    try:
        import huggingface_hub as hub  # lazy: optional, and only for Hub ids
        from huggingface_hub import constants  # lazy: as above
        from huggingface_hub.errors import EntryNotFoundError  # lazy: as above
    except ImportError:
        return None
    try:
        cached = hub.try_to_load_from_cache(model, EXPORT_RECORD, revision=revision)
    except ValueError:  # not a repository id at all (a path that does not exist)
        return None
    if isinstance(cached, str):
        return Path(cached).parent
    if cached is not None or constants.HF_HUB_OFFLINE:
        return None  # the cache knows the repository holds no record, or no Hub to ask
    try:
        return Path(hub.hf_hub_download(model, EXPORT_RECORD, revision=revision)).parent
    except EntryNotFoundError:
        return None  # the repository is no export of this library
    except Exception as err:  # noqa: BLE001 - the Hub unreachable: said, not hidden
        logger.warning(
            "fsdp-precision: could not look for %s in the Hub repository %r (%s); if it is an "
            "export, its kept tensors are not declared to the engine: declare them with "
            "%s=<file declare_kept() wrote>",
            EXPORT_RECORD, model, err, KEPT_ENV,
        )  # fmt: skip
        return None


def resolve_kept(
    model: str,
    *,
    revision: str | None = None,
    declared: object = None,
    environ: Mapping[str, str] | None = None,
) -> EngineKept | None:
    """What the engine serving ``model`` (a directory or a Hub id) must keep, or ``None``
    (nothing: the engine runs as it would without the library).

    ``declared``: the engine configuration's :data:`CONFIG_KEY` entry (a path or an inline
    document); else :data:`KEPT_ENV` in ``environ`` (default: ``os.environ``). A declaration and
    an export record beside the model that disagree raise
    :class:`~fsdp_precision.EngineDtypeError` naming the difference."""
    environ = os.environ if environ is None else environ
    if declared is None and environ.get(KEPT_ENV):
        declared = environ[KEPT_ENV]
    if declared is not None and not isinstance(declared, (str, os.PathLike, Mapping)):
        raise EngineDtypeError(
            f"the engine's {CONFIG_KEY!r} configuration is {declared!r}; pass the path of a "
            "file declare_kept() wrote, or the document itself"
        )
    local = Path(model)
    directory = local if local.is_dir() else _hub_record(model, revision)
    recorded = kept_of_export(directory) if directory is not None else None
    if declared is None:
        return recorded
    kept = read_declaration(declared)
    if recorded is not None and dict(recorded.tensors) != dict(kept.tensors):
        differ = sorted(set(recorded.tensors.items()) ^ set(kept.tensors.items()))
        raise EngineDtypeError(
            f"'{model}' holds an export record ({recorded.source}) that keeps other tensors "
            f"than the declaration {kept.source} (differing: "
            f"{', '.join(f'{n} {dtype_name(d)}' for n, d in differ[:6])}); start the engine "
            "from the export alone, or declare what the export keeps"
        )
    return kept
