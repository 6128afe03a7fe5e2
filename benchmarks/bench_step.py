"""Step time and collectives of the patched path, measured side by side in one run.

    python benchmarks/bench_step.py [--nproc 2] [--iters 30] [--dim 256] [--depth 4]

Two comparisons, each interleaved step by step so machine noise hits both sides alike:

1. overhead: the patched path with an empty map against unpatched torch (same uniform bf16
   policy). The patch is removed and re-applied between steps (outside the timed region).
2. mixed map: norms and router mapped to fp32 inside bf16 units, against the uniform bf16 policy;
   plus all-gather bytes against their lower bound (numel x compute itemsize, no padding) and
   collective counts against the public-API alternative (separate fp32 child units).

Prints a markdown table (rank 0) and writes JSON to --out when given.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fsdp_precision as fp
from fsdp_precision._cli._demo import _wrap_mapped, _wrap_reference
from fsdp_precision._cli._tiny import TinyConfig, TinyDecoder
from fsdp_precision._observe import CollectiveRecorder

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def wrap_uniform(model: TinyDecoder, policy: MixedPrecisionPolicy) -> None:
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def step_fn(model: TinyDecoder, cfg: TinyConfig):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, cfg.vocab, (4, cfg.seq + 1), generator=g)

    def step() -> float:
        start = time.perf_counter()
        model.loss(tokens).backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - start

    return step


def synced(step) -> float:
    dist.barrier()
    t = step()
    t_max = torch.tensor([t])
    dist.all_reduce(t_max, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    return float(t_max.item())


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.nproc, timeout=timedelta(300))
    cfg = TinyConfig(dim=args.dim, depth=args.depth)
    torch.manual_seed(0)
    base = TinyDecoder(cfg)
    models = {
        k: copy.deepcopy(base) for k in ("unpatched", "empty_map", "uniform", "mapped", "children")
    }

    fp.apply_param_dtype_map_patch()
    fp.remove_param_dtype_map_patch()
    wrap_uniform(models["unpatched"], BF16)
    fp.apply_param_dtype_map_patch()
    wrap_uniform(
        models["empty_map"],
        fp.ParamDtypeMixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    wrap_uniform(models["uniform"], BF16)
    _wrap_mapped(models["mapped"])
    _wrap_reference(models["children"])
    steps = {k: step_fn(m, cfg) for k, m in models.items()}

    def run_unpatched() -> float:
        fp.remove_param_dtype_map_patch()
        try:
            return synced(steps["unpatched"])
        finally:
            fp.apply_param_dtype_map_patch()

    # Lazy init and warm-up.
    for _ in range(3):
        run_unpatched()
        for k in ("empty_map", "uniform", "mapped", "children"):
            synced(steps[k])

    times: dict[str, list[float]] = {k: [] for k in models}
    for i in range(args.iters):
        order = ["unpatched", "empty_map", "uniform", "mapped", "children"]
        if i % 2:
            order.reverse()
        for k in order:
            times[k].append(run_unpatched() if k == "unpatched" else synced(steps[k]))

    collectives = {}
    for k in ("uniform", "mapped", "children"):
        with CollectiveRecorder() as rec:
            steps[k]()
        gathers = rec.of("all_gather")
        collectives[k] = {
            "all_gathers": len(gathers),
            "reduce_scatters": rec.count("reduce_scatter"),
            "all_gather_bytes": sum(g.output_bytes for g in gathers),
        }
    # Lower bound of one forward+backward's all-gathered bytes for the mapped model: every
    # unit gathers its parameters in their compute dtype with no padding at all.
    keep = {
        n
        for n, _ in base.named_parameters()
        if n.endswith(("attn_norm.weight", "mlp_norm.weight", "router.weight"))
        or n == "norm.weight"
    }
    per_unshard = {}
    for n, p in base.named_parameters():
        unit = n.split(".")[0] + "." + n.split(".")[1] if n.startswith("blocks.") else "<root>"
        per_unshard[unit] = per_unshard.get(unit, 0) + p.numel() * (4 if n in keep else 2)
    # blocks are unsharded twice (forward, backward), the root once
    lower = sum(b * (1 if u == "<root>" else 2) for u, b in per_unshard.items())

    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        ratios = {
            "empty_map_over_unpatched": statistics.median(
                a / b for a, b in zip(times["empty_map"], times["unpatched"], strict=True)
            ),
            "uniform_patched_over_unpatched": statistics.median(
                a / b for a, b in zip(times["uniform"], times["unpatched"], strict=True)
            ),
            "mapped_over_uniform": statistics.median(
                a / b for a, b in zip(times["mapped"], times["uniform"], strict=True)
            ),
            "children_over_uniform": statistics.median(
                a / b for a, b in zip(times["children"], times["uniform"], strict=True)
            ),
        }
        result = {
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
            "torch": torch.__version__,
            "nproc": args.nproc,
            "iters": args.iters,
            "model": f"TinyDecoder dim={cfg.dim} depth={cfg.depth} seq={cfg.seq}",
            "median_step_s": med,
            "median_paired_ratio": ratios,
            "collectives_per_step": collectives,
            "mapped_all_gather_bytes_lower_bound": lower,
        }
        print(json.dumps(result, indent=2))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(
        worker, args=(args, port), nprocs=args.nproc, join=True, start_method="spawn"
    )


if __name__ == "__main__":
    main()
