"""The export's peak host memory and bandwidth: streaming unit by unit against consolidating first.

    python benchmarks/bench_export.py [--nproc 2] [--repeats 3] [--dim 1024] [--depth 8]
        [--experts 4] [--shard-mb 200] [--dir DIR] [--smoke] [--offline-only]

One FSDP2 model (a ``TinyDecoder``, fp32, one unit per block and the root, norms kept by a
``model_policy``) built on the meta device and materialised shard by shard, so no rank ever held
the whole model before the measurement. Variants, each in a fresh process group:

- ``streaming``: ``export_safetensors(model, dir, max_shard_size=...)``: one unit gathered at a
  time, each output file written as soon as its last tensor arrived (this library).
- ``consolidate``: the way exports worked before: ``get_model_state_dict(full_state_dict=True,
  cpu_offload=True)`` (the whole model on rank 0), then one ``safetensors`` file.
- ``torch_save``: ``torch.save`` of the consolidated tensors on rank 0, the gather not timed:
  the floor for writing the same bytes.
- ``handoff``: ``full_weights(model, ranks="rank0", device="cpu")`` iterated to the end, each
  tensor dropped as a consumer that copies it into an engine would: the hand-off's own cost.

Offline exports (``export_safetensors(checkpoint_dir, ...)``, one process, no model): the same
model saved by ``save_checkpoint`` (sharded, ``--nproc`` ranks), then exported in a fresh
process:

- ``offline_layers``: the ``TinyDecoder`` checkpoint (blocks named ``blocks.N``; the embedding,
  final norm and head in no block).
- ``offline_root``: ``--depth`` dense blocks (``dim -> 8 dim -> dim``) in an ``nn.Sequential``,
  so the blocks sit at the root (``0.up.weight``, ``1.up.weight``, ...), as a model without a
  container names them.

Memory: rank 0's peak resident set during the variant (``resource.getrusage``'s ``ru_maxrss``
after it, less the resident set before it; the meta-device build keeps the earlier peak below),
in MB and as a multiple of the model's bytes and of its largest unit (what the streaming export
holds at once: one unit's full tensors; each tensor's bytes go to its file as they arrive).
Time: wall time of the variant on rank 0 (the ranks finish together: it is collective); MB/s is
the model's bytes over it. ``--repeats`` rounds, the variants' order reversed every
other round; ratios are medians of per-round ratios against ``consolidate``. Prints a markdown
table and JSON (rank 0). ``--smoke``: a tiny model, one round, the same code path, seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

import fsdp_precision as fp
from fsdp_precision.checkpoint import export_safetensors, save_checkpoint
from fsdp_precision.testing import TinyConfig, TinyDecoder, launch, process_group

VARIANTS = ("streaming", "consolidate", "torch_save", "handoff")
OFFLINE = ("offline_layers", "offline_root")
MB = 1e6


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _build(cfg: TinyConfig) -> tuple[torch.nn.Module, int, int]:
    """The wrapped model, materialised shard by shard; (model, total bytes, largest unit's)."""
    with torch.device("meta"):
        model = TinyDecoder(cfg)
    policy = fp.model_policy(
        model,
        fp.PrecisionRules(
            param_dtype=torch.bfloat16, rules=(fp.Glob("*norm.weight"),), advice="off"
        ),
    )
    units = list(model.blocks)
    unit_bytes = [sum(p.numel() * 4 for p in u.parameters()) for u in units]
    for unit in units:
        fully_shard(unit, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(dist.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local()  # type: ignore[attr-defined]
            local.copy_(torch.randn(local.shape, generator=g) * 0.02)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    root_bytes = total - sum(unit_bytes)
    return model, total, max([*unit_bytes, root_bytes])


def _job(variant: str, cfg: TinyConfig, shard_bytes: int, directory: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    with process_group():
        fp.apply_param_dtype_map_patch()
        model, total, largest_unit = _build(cfg)
        out = Path(directory) / f"{variant}-{os.getpid()}"
        state: dict[str, torch.Tensor] = {}
        if variant == "torch_save":  # the gather is not the floor's: outside the timed region
            state = get_model_state_dict(
                model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        dist.barrier()
        before = _rss_bytes()
        start = time.perf_counter()
        if variant == "streaming":
            export_safetensors(model, out, max_shard_size=shard_bytes)
        elif variant == "consolidate":
            full = get_model_state_dict(
                model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
            if dist.get_rank() == 0:
                from safetensors.torch import save_file

                out.mkdir(parents=True)
                save_file(
                    {k: v.contiguous() for k, v in full.items()}, str(out / "model.safetensors")
                )
            del full
        elif variant == "torch_save":
            if dist.get_rank() == 0:
                out.mkdir(parents=True)
                torch.save(state, out / "model.pt")
        else:
            for _name, tensor in fp.full_weights(model, ranks="rank0", device="cpu"):
                del tensor
        dist.barrier()
        seconds = time.perf_counter() - start
        peak = max(0, _peak_bytes() - before)
        if dist.get_rank() == 0:
            shutil.rmtree(out, ignore_errors=True)
        return {
            "variant": variant,
            "seconds": seconds,
            "peak_bytes": peak,
            "model_bytes": total,
            "largest_unit_bytes": largest_unit,
        }


class _Dense(torch.nn.Module):
    """A block whose tensors carry no number of their own: ``0.up.weight`` at the root."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(dim, 8 * dim)
        self.down = torch.nn.Linear(8 * dim, dim)


def _offline_model(variant: str, cfg: TinyConfig) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """The model of an offline variant on meta, and its blocks."""
    with torch.device("meta"):
        if variant == "offline_layers":
            decoder = TinyDecoder(cfg)
            return decoder, list(decoder.blocks)
        root = torch.nn.Sequential(*(_Dense(cfg.dim) for _ in range(cfg.depth)))
    return root, list(root)


def _save(variant: str, cfg: TinyConfig, directory: str) -> dict[str, int]:
    """Every rank: the offline variant's model, sharded and materialised shard by shard, saved
    by ``save_checkpoint`` into ``directory``; its bytes and its largest block's."""
    torch.set_num_threads(1)
    with process_group():
        model, blocks = _offline_model(variant, cfg)
        for block in blocks:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cpu")
        g = torch.Generator().manual_seed(dist.get_rank())
        with torch.no_grad():
            for p in model.parameters():
                local = p.to_local()  # type: ignore[attr-defined]
                local.copy_(torch.randn(local.shape, generator=g) * 0.02)
        save_checkpoint(directory, model, checksums=False)
        return {
            "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "largest_unit_bytes": max(
                sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks
            ),
        }


def _export_offline(directory: str, out: str, shard_bytes: int) -> dict[str, float]:
    """In a fresh process: the offline export's wall time and peak resident set above the
    resident set before it."""
    torch.set_num_threads(1)
    before = _rss_bytes()
    start = time.perf_counter()
    export_safetensors(directory, out, max_shard_size=shard_bytes)
    seconds = time.perf_counter() - start
    shutil.rmtree(out, ignore_errors=True)
    return {"seconds": seconds, "peak_bytes": max(0, _peak_bytes() - before)}


def _offline(
    variant: str, cfg: TinyConfig, shard_bytes: int, directory: str, nproc: int
) -> dict[str, Any]:
    ckpt = str(Path(directory) / f"{variant}-ckpt")
    sizes = launch(_save, (variant, cfg, ckpt), nproc=nproc)
    measured = launch(_export_offline, (ckpt, ckpt + "-out", shard_bytes), nproc=1)
    shutil.rmtree(ckpt, ignore_errors=True)
    return {"variant": variant, **sizes, **measured}


def _offline_rows(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, float]]:
    rows = {}
    for v in OFFLINE:
        model_bytes = rounds[0][v]["model_bytes"]
        unit = rounds[0][v]["largest_unit_bytes"]
        secs = statistics.median(r[v]["seconds"] for r in rounds)
        peak = statistics.median(r[v]["peak_bytes"] for r in rounds)
        rows[v] = {
            "model_mb": model_bytes / MB,
            "largest_block_mb": unit / MB,
            "seconds": secs,
            "mb_per_s": model_bytes / MB / secs,
            "peak_mb": peak / MB,
            "peak_over_model": peak / model_bytes,
            "peak_over_block": peak / unit,
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--shard-mb", type=float, default=200.0)
    parser.add_argument("--dir", default=None, help="where files are written (default: a tmp dir)")
    parser.add_argument("--smoke", action="store_true", help="tiny model, one round (CI)")
    parser.add_argument("--offline-only", action="store_true", help="the offline variants only")
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.dim, args.depth, args.experts, args.shard_mb = 1, 64, 2, 2, 0.05
    cfg = TinyConfig(vocab=8192 if not args.smoke else 256, dim=args.dim, depth=args.depth,
                     heads=8 if not args.smoke else 4, experts=args.experts)  # fmt: skip
    shard_bytes = int(args.shard_mb * MB)
    directory = args.dir or tempfile.mkdtemp(prefix="bench-export-")
    rounds: list[dict[str, dict[str, Any]]] = []
    offline: list[dict[str, dict[str, Any]]] = []
    for r in range(args.repeats):
        order = OFFLINE if r % 2 == 0 else tuple(reversed(OFFLINE))
        offline.append({v: _offline(v, cfg, shard_bytes, directory, args.nproc) for v in order})
        if args.offline_only:
            continue
        order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
        rounds.append(
            {v: launch(_job, (v, cfg, shard_bytes, directory), nproc=args.nproc) for v in order}
        )
    if args.dir is None:
        shutil.rmtree(directory, ignore_errors=True)
    offline_table = _offline_rows(offline)
    print(f"offline exports (one process), shard {shard_bytes / MB:.0f} MB, medians of "
          f"{args.repeats} rounds")  # fmt: skip
    print(
        "| variant | model MB | largest block MB | s | MB/s | peak MB | x model | x largest block |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for v, row in offline_table.items():
        cells = [f"{row[k]:.0f}" for k in ("model_mb", "largest_block_mb")]
        cells += [f"{row['seconds']:.2f}", f"{row['mb_per_s']:.0f}", f"{row['peak_mb']:.0f}"]
        cells += [f"{row[k]:.2f}" for k in ("peak_over_model", "peak_over_block")]
        print(f"| {v} | " + " | ".join(cells) + " |")
    if args.offline_only:
        print(json.dumps({"command": " ".join(sys.argv), "offline": offline_table}, indent=2))
        return
    model_bytes = rounds[0]["streaming"]["model_bytes"]
    unit = rounds[0]["streaming"]["largest_unit_bytes"]
    table: dict[str, dict[str, float]] = {}
    for v in VARIANTS:
        secs = [r[v]["seconds"] for r in rounds]
        peaks = [r[v]["peak_bytes"] for r in rounds]
        table[v] = {
            "seconds": statistics.median(secs),
            "mb_per_s": model_bytes / MB / statistics.median(secs),
            "peak_mb": statistics.median(peaks) / MB,
            "peak_over_model": statistics.median(peaks) / model_bytes,
            "peak_over_unit": statistics.median(peaks) / unit,
            "time_over_consolidate": statistics.median(
                r[v]["seconds"] / r["consolidate"]["seconds"] for r in rounds
            ),
            "peak_over_consolidate": statistics.median(
                r[v]["peak_bytes"] / max(r["consolidate"]["peak_bytes"], 1) for r in rounds
            ),
        }
    result = {
        "command": " ".join(sys.argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
        "torch": torch.__version__,
        "nproc": args.nproc,
        "repeats": args.repeats,
        "model_mb": model_bytes / MB,
        "largest_unit_mb": unit / MB,
        "shard_mb": shard_bytes / MB,
        "variants": table,
        "offline": offline_table,
    }
    print(f"model {model_bytes / MB:.0f} MB on {args.nproc} ranks; largest unit "
          f"{unit / MB:.0f} MB; medians of {args.repeats} rounds")  # fmt: skip
    print("| variant | s | MB/s | rank 0 peak MB | x model | x largest unit | time / consolidate "
          "| peak / consolidate |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for v, row in table.items():
        cells = [f"{row['seconds']:.2f}", f"{row['mb_per_s']:.0f}", f"{row['peak_mb']:.0f}"]
        cells += [f"{row[k]:.2f}" for k in ("peak_over_model", "peak_over_unit")]
        cells += [f"{row[k]:.2f}" for k in ("time_over_consolidate", "peak_over_consolidate")]
        print(f"| {v} | " + " | ".join(cells) + " |")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
