"""A checkpoint directory as a weight stream, without the model: what an export reads offline.

Names, shapes and storage dtypes come from DCP's metadata; which tensors training kept in which
dtype, the layout and the boundary casts from the marker ``save_checkpoint`` wrote (its
``precision`` field). One numbered block at a time is read (DCP loads only the keys asked for):
``model.layers.3``, or ``3`` where the blocks sit at the root (an ``nn.Sequential``); the tensors
of no block (embeddings, the head, final norms) a module at a time, as many modules together as
fit in one output shard. What is resident is about one block or one output shard, whatever the
names.
A transformers checkpoint's names are converted to the Hub's with transformers' own reversal, on
the model built from its ``config.json`` on the meta device (no weights, no remote code).
"""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from fsdp_precision._base.dtypes import dtype_from_name
from fsdp_precision._base.errors import CheckpointError, CheckpointReadError
from fsdp_precision._base.quiet import quiet_imports
from fsdp_precision._edges.checkpoint.collective import (
    CheckpointException,
    describe,
    single_process,
)
from fsdp_precision._edges.checkpoint.integrity import verify_checksums
from fsdp_precision._edges.checkpoint.metadata import (
    MODEL,
    dcp_metadata,
    read_metadata,
    saved_tensors,
)
from fsdp_precision._edges.entries import Dtype, WeightEntry, block_of
from fsdp_precision._edges.layouts import Layout, LayoutName, layout_for
from fsdp_precision._edges.record import parse_casts
from fsdp_precision._edges.stream import WeightStream, plan_stream
from fsdp_precision._trust.reader import check_files, trusted_load

__all__ = ["checkpoint_stream"]


def _natural(name: str) -> list[Any]:
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]


def checkpoint_stream(
    path: Path, dtype: Dtype, layout: LayoutName, group_bytes: int
) -> tuple[WeightStream, Layout]:
    """The stream of checkpoint ``path``'s model tensors (with its recorded casts), its layout;
    each read brings one numbered block, or modules of no block up to ``group_bytes`` (one
    output shard) together."""
    meta = read_metadata(path)
    check_files(path, dcp_metadata(path))  # nothing read before every file checks out
    error = verify_checksums(meta.get("checksums"), path, path, collective=False)
    if error is not None:
        raise error
    precision = meta.get("precision") or {}
    kept = precision.get("kept")
    if kept is None and dtype != "stored":
        raise CheckpointError(
            f"checkpoint '{path}' records no kept dtypes (written by an earlier fsdp-precision), "
            f"so dtype={dtype!r} could round a kept router or norm; export it with "
            "dtype='stored', or export the loaded model"
        )
    kept = kept or {}
    saved = saved_tensors(path, MODEL)
    bulk = dtype_from_name(precision.get("bulk")) or _most_common(saved)
    entries = []
    for name in sorted(saved, key=_natural):
        shape, storage = saved[name]
        found = kept.get(name)
        compute = storage
        if isinstance(found, dict) and dtype_from_name(found.get("dtype")) is not None:
            compute = dtype_from_name(found.get("dtype"))  # type: ignore[assignment]
        elif storage.is_floating_point:
            compute = bulk
        entries.append(
            WeightEntry(
                name=name,
                tensor=torch.empty(shape, dtype=storage, device="meta"),
                shape=shape,
                storage=storage,
                compute=compute,
                group=block_of(name),
                kept=str(found.get("reason")) if isinstance(found, dict) else None,
            )
        )
    entries = _bounded(entries, group_bytes)
    chosen = _layout(path, precision.get("layout"), layout)

    def fetch(
        group: Sequence[WeightEntry], dtypes: Sequence[torch.dtype]
    ) -> dict[str, torch.Tensor]:
        template = {e.name: torch.empty(e.shape, dtype=e.storage) for e in group}
        try:
            with single_process():
                trusted_load({MODEL: template}, path, no_dist=True)
        except (OSError, CheckpointException) as err:
            raise CheckpointReadError(
                f"cannot read the model tensors of checkpoint '{path}' ({describe(err)}); a "
                "file of the checkpoint is missing or damaged: export an earlier checkpoint"
            ) from err
        return {n: t.to(d) for (n, t), d in zip(template.items(), dtypes, strict=True)}

    stream = plan_stream(entries, bulk, dtype=dtype, cast_kept=False, layout=chosen, fetch=fetch)
    stream.casts = parse_casts(precision.get("casts", {}), str(path))
    return stream, chosen


def _bounded(entries: list[WeightEntry], limit: int) -> list[WeightEntry]:
    """``entries`` with those of no numbered block in groups of whole modules, at most ``limit``
    bytes stored each (a module larger than that alone): they were read all at once."""
    runs: list[list[WeightEntry]] = []  # a numbered entry, or one module's consecutive entries
    for entry in entries:
        owner = entry.name.rpartition(".")[0]
        last = runs[-1][-1] if runs else None
        same = last is not None and not last.group and last.name.rpartition(".")[0] == owner
        if entry.group or not same:
            runs.append([])
        runs[-1].append(entry)
    out: list[WeightEntry] = []
    chunk = size = 0
    previous_numbered = True
    for run in runs:
        if run[0].group:
            out.extend(run)
            previous_numbered = True
            continue
        nbytes = sum(int(torch.Size(e.shape).numel()) * e.storage.itemsize for e in run)
        if previous_numbered or size + nbytes > limit:
            chunk, size = chunk + 1, 0
        previous_numbered = False
        size += nbytes
        out.extend(replace(e, group=f"<no block #{chunk}>") for e in run)
    return out


def _most_common(saved: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> torch.dtype:
    counts: Counter[torch.dtype] = Counter()
    for shape, dtype in saved.values():
        if dtype.is_floating_point:
            counts[dtype] += int(torch.Size(shape).numel())
    return counts.most_common(1)[0][0] if counts else torch.float32


def _layout(path: Path, recorded: object, asked: LayoutName) -> Layout:
    """The layout of an offline export: asked for, else recorded, else guessed from the config."""
    config = path / "config.json"
    name = asked if asked != "auto" else recorded
    if name is None:
        name = "plain"
        if config.is_file():
            text = config.read_text()
            name = "diffusers" if '"_class_name"' in text else "transformers"
    if name == "plain":
        return layout_for(torch.nn.Module(), "plain")
    if name == "diffusers":
        return _copied_config("diffusers", "diffusion_pytorch_model.safetensors", config)
    if name == "transformers":
        return layout_for(_meta_model(path), "transformers")
    raise CheckpointError(
        f"checkpoint '{path}' holds a {name!r} model, which an offline export cannot lay out; "
        "export the loaded model instead (export_safetensors(model, ...), collective), or pass "
        "layout='plain'"
    )


def _copied_config(name: str, weights: str, config: Path) -> Layout:
    def save(out: Path, dtype: torch.dtype | None) -> list[str]:
        if not config.is_file():
            return []
        shutil.copyfile(config, out / "config.json")
        return ["config.json"]

    return Layout(name, weights, lambda group: group, save)


def _meta_model(path: Path) -> torch.nn.Module:
    """The transformers model of ``path/config.json``, on meta (its class, never remote code)."""
    try:  # lazy: an optional dependency
        import transformers
    except ImportError as exc:
        raise CheckpointError(
            f"checkpoint '{path}' holds a transformers model; its export needs transformers: "
            "pip install 'fsdp-precision[hf]' (or pass layout='plain')"
        ) from exc
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=False)
        architecture = (getattr(config, "architectures", None) or [None])[0]
        with quiet_imports():  # the model class imports torchao: its import-time noise
            cls = getattr(transformers, str(architecture), None)
        if cls is None:
            raise ValueError(f"architectures={getattr(config, 'architectures', None)!r}")
        with torch.device("meta"):
            return cls._from_config(config)  # type: ignore[no-any-return]
    except Exception as err:  # noqa: BLE001 - any failure: the config cannot say the model
        raise CheckpointError(
            f"cannot build the model of checkpoint '{path}' from its config.json ({err!r}); "
            "export the loaded model instead (export_safetensors(model, ...)), or pass "
            "layout='plain'"
        ) from err
