"""Checkpoint save/load throughput: sharded and full DCP checkpoints against plain torch.save/load.

    python benchmarks/bench_checkpoint.py [--nproc 2] [--iters 5] [--dim 1024] [--depth 8] [--smoke]

One FSDP2 model (one unit per layer, bf16 storage with fp32 norms in the same units, so the
mixed-dtype path is the one measured) and its AdamW state, on ``--nproc`` gloo ranks (CPU).
Every iteration runs every variant once, in an order rotated per iteration, so machine noise hits
all of them alike; a variant's time is its slowest rank's; the table shows medians. Throughput is
the state's total bytes (model + optimizer, all ranks) divided by that time.

Variants (save, then load, into a fresh directory each time):

- ``save_checkpoint(..., "sharded")`` / ``load_checkpoint``: every rank writes and reads its shards;
  the save records every file's checksum and the load verifies them (the default).
- ``save_checkpoint(..., "full")`` / ``load_checkpoint``: consolidated on rank 0, which writes;
  every rank reads its slices.
- ``torch.save`` / ``torch.load`` of each rank's local shards (one file per rank): the floor.
- ``torch.save`` / ``torch.load`` of the consolidated state on rank 0 (gather not timed, load
  followed by ``load_model_state_dict``-free placement not timed either): raw serialisation.

The files go to ``--dir`` (default: a temporary directory); reads are mostly served from the page
cache. Prints a markdown table (rank 0), then what the checksums cost: sharded saves and loads
with and without them (``checksums=False``), in pairs whose order alternates, as ratios.
``--smoke``: a tiny model and one iteration, the same code path, in seconds.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

import fsdp_precision as fp
from fsdp_precision.checkpoint import load_checkpoint, save_checkpoint
from fsdp_precision.testing import launch, process_group


class Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def build(dim: int, depth: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[Layer(dim) for _ in range(depth)]).to(torch.bfloat16)
    for layer in model:
        layer.norm.float()
    for layer in model:
        keep = {"norm.weight": torch.float32, "norm.bias": torch.float32}
        policy = fp.ParamDtypeMixedPrecisionPolicy(
            param_dtype=None, reduce_dtype=torch.float32, param_dtype_map=keep
        )
        fully_shard(layer, mp_policy=policy)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(2, dim, dtype=torch.bfloat16)
    model(x).float().sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # global shapes
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                total += value.numel() * value.element_size()  # DTensor: global numel
    return total


def timed(fn: Callable[[], None]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def local_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, object]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def worker(args: argparse.Namespace, base: str) -> None:
    torch.set_num_threads(1)
    with process_group(timeout_s=600):
        measure(dist.get_rank(), args, base)


def measure(rank: int, args: argparse.Namespace, base: str) -> None:
    fp.apply_param_dtype_map_patch()
    model, opt = build(args.dim, args.depth)
    fresh, fresh_opt = build(args.dim, args.depth)
    size = state_bytes(model, opt)
    full_opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full_msd, full_osd = get_state_dict(model, opt, options=full_opts)
    root = Path(base)

    def plain_shards_save(path: Path) -> None:
        path.mkdir(exist_ok=True)
        torch.save(local_state(model, opt), path / f"rank{rank}.pt")

    def plain_shards_load(path: Path) -> None:
        torch.load(path / f"rank{rank}.pt", weights_only=False)

    def plain_full_save(path: Path) -> None:
        if rank == 0:
            torch.save({"model": full_msd, "optim": full_osd}, path)

    def plain_full_load(path: Path) -> None:
        if rank == 0:
            torch.load(path, weights_only=False)

    variants: dict[str, tuple[Callable[[Path], None], Callable[[Path], None]]] = {
        "DCP sharded (save_checkpoint)": (
            lambda p: save_checkpoint(p, model, opt, state_dict_type="sharded") and None,
            lambda p: load_checkpoint(p, fresh, fresh_opt) and None,
        ),
        "DCP full (save_checkpoint)": (
            lambda p: save_checkpoint(p, model, opt, state_dict_type="full") and None,
            lambda p: load_checkpoint(p, fresh, fresh_opt) and None,
        ),
        "torch.save per-rank shards": (plain_shards_save, plain_shards_load),
        "torch.save full state on rank 0": (plain_full_save, plain_full_load),
    }
    names = list(variants)
    times: dict[str, dict[str, list[float]]] = {n: {"save": [], "load": []} for n in names}
    for it in range(args.iters + 1):  # iteration 0 is a warm-up
        order = names[it % len(names) :] + names[: it % len(names)]
        for name in order:
            save, load = variants[name]
            path = root / f"v{names.index(name)}-{it}"
            t_save = timed(lambda: save(path))  # noqa: B023
            t_load = timed(lambda: load(path))  # noqa: B023
            if it:
                times[name]["save"].append(t_save)
                times[name]["load"].append(t_load)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()
    if rank == 0:
        mb = size / 1e6
        print(f"\nstate: {mb:.1f} MB (model + AdamW, bf16 storage with fp32 norms), ")
        print(f"{args.nproc} gloo ranks, {args.iters} iterations, medians; slowest rank\n")
        print("| variant | save (s) | save MB/s | load (s) | load MB/s |")
        print("|---|---|---|---|---|")
        for name in names:
            s = statistics.median(times[name]["save"])
            ld = statistics.median(times[name]["load"])
            print(f"| {name} | {s:.3f} | {mb / s:.0f} | {ld:.3f} | {mb / ld:.0f} |")
    ratios = checksum_cost(model, opt, fresh, fresh_opt, root, args.iters)
    if rank == 0:
        print(
            f"\nchecksums (sharded; with/without, paired, order alternated, median of "
            f"{args.iters}): save {ratios['save']:.2f}x, load {ratios['load']:.2f}x"
        )
        print(
            f"\ncommand: python {' '.join(sys.argv)}\nmachine: {platform.machine()}, "
            f"{os.cpu_count()} cores, torch {torch.__version__}"
        )
    dist.barrier()


def checksum_cost(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    fresh: nn.Module,
    fresh_opt: torch.optim.Optimizer,
    root: Path,
    iters: int,
) -> dict[str, float]:
    """What the checksums cost: sharded saves and loads with and without them, run in pairs
    whose order alternates (the first save after other work runs slower: a fixed order measured
    1.6x between two identical variants), each ratio over two pairs, one in each order."""
    times: dict[bool, dict[str, list[float]]] = {c: {"save": [], "load": []} for c in (True, False)}
    for it in range(2 * iters + 1):  # iteration 0 is a warm-up
        for checksums in (True, False) if it % 2 else (False, True):
            path = root / f"sums-{checksums}-{it}"
            t_save = timed(lambda: save_checkpoint(path, model, opt, checksums=checksums) and None)  # noqa: B023
            t_load = timed(lambda: load_checkpoint(path, fresh, fresh_opt) and None)  # noqa: B023
            if it:
                times[checksums]["save"].append(t_save)
                times[checksums]["load"].append(t_load)
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(path, ignore_errors=True)
    ratios = {}
    for kind in ("save", "load"):
        with_, without = times[True][kind], times[False][kind]
        pairs = [
            (with_[i] + with_[i + 1]) / (without[i] + without[i + 1])
            for i in range(0, len(with_) - 1, 2)
        ]
        ratios[kind] = statistics.median(pairs)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (CI)")
    args = parser.parse_args()
    if args.smoke:
        args.iters, args.dim, args.depth = 1, 32, 2
    with tempfile.TemporaryDirectory(dir=args.dir) as base:
        launch(worker, (args, base), nproc=args.nproc)


if __name__ == "__main__":
    main()
