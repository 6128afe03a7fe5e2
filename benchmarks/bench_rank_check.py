"""What the rank agreement costs: ``fully_shard`` construction with and without it, side by side.

    python benchmarks/bench_rank_check.py [--nproc 2] [--iters 20] [--depth 8] [--smoke]

While the patch is installed, every ``fully_shard`` call compares a 16-byte digest of what it
resolved across its mesh's ranks (one all-gather at construction;
``apply_param_dtype_map_patch(check_ranks=...)``). Each iteration wraps a fresh TinyDecoder
(one mapped unit per block, then the root: ``depth + 1`` calls) with the check on and with it
off, in an order reversed every other iteration; a wrap's time is its slowest rank's. Reported:
the median wrap time of each, their median paired difference per call, and the collectives a
wrap issues. Nothing runs per training step: the check is construction-time only. ``--smoke``:
depth 2, two iterations, the same code path. Prints JSON (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

import fsdp_precision as fp
from fsdp_precision.testing import (
    CollectiveRecorder,
    TinyConfig,
    TinyDecoder,
    launch,
    process_group,
)

RULES = fp.PrecisionRules(rules=(fp.Glob("*norm.weight"), fp.Glob("*router.weight")), advice="off")


def wrap(cfg: TinyConfig, check: bool) -> tuple[float, int]:
    """Seconds to wrap (slowest rank) and the all-gathers the wrap issued."""
    fp.apply_param_dtype_map_patch(check_ranks=check)
    torch.manual_seed(0)
    model = TinyDecoder(cfg)
    plan = fp.compile_param_dtype_maps(model, RULES, [*model.blocks, model])
    dist.barrier()
    with CollectiveRecorder() as recorder:
        start = time.perf_counter()
        plan.apply()
        took = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took.item()), recorder.count("all_gather")


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    with process_group(timeout_s=300):
        cfg = TinyConfig(dim=64, depth=args.depth)
        times: dict[bool, list[float]] = {True: [], False: []}
        gathers: dict[bool, int] = {}
        for i in range(args.iters):
            for check in (True, False) if i % 2 == 0 else (False, True):
                took, gathers[check] = wrap(cfg, check)
                times[check].append(took)
        fp.apply_param_dtype_map_patch(check_ranks=True)
        if gathers[True] - gathers[False] != args.depth + 1:
            raise SystemExit(f"expected one all-gather per call: {gathers}")
        if dist.get_rank() == 0:
            calls = args.depth + 1
            diffs = [(a - b) / calls for a, b in zip(times[True], times[False], strict=True)]
            print(json.dumps({
                "command": f"python benchmarks/bench_rank_check.py --nproc {args.nproc} "
                           f"--iters {args.iters} --depth {args.depth}",
                "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                "torch": torch.__version__,
                "fully_shard_calls_per_wrap": calls,
                "median_wrap_s": {"checked": statistics.median(times[True]),
                                  "unchecked": statistics.median(times[False])},
                "median_paired_cost_per_call_s": statistics.median(diffs),
                "all_gathers_per_wrap": {"checked": gathers[True], "unchecked": gathers[False]},
            }, indent=2))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (CI)")
    args = parser.parse_args()
    if args.smoke:
        args.iters, args.depth = 2, 2
    launch(worker, (args,), nproc=args.nproc)


if __name__ == "__main__":
    main()
