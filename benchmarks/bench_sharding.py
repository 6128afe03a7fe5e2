"""Per-rank parameter and optimizer-state bytes against world size (sharding efficiency).

    python benchmarks/bench_sharding.py [--world-sizes 1 2 4] [--dim 128] [--depth 4] [--smoke]

Wraps the demo's TinyDecoder with wrap_model_for_training (FSDP, bf16 compute, norms and router
in fp32, one unit per block), takes one AdamW step, and reports the largest rank's bytes of
sharded parameters and of optimizer state against the ideal total / world size. ``--smoke``: a
tiny model on 1 and 2 ranks, the same code path, in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist

from fsdp_precision import DistributedConfig, Glob, PrecisionRules, wrap_model_for_training
from fsdp_precision.testing import TinyConfig, TinyDecoder, launch, process_group


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def worker(world: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    with process_group(timeout_s=300):
        measure(dist.get_rank(), world, args, out)


def measure(rank: int, world: int, args: argparse.Namespace, out: str) -> None:
    torch.manual_seed(0)
    cfg = TinyConfig(dim=args.dim, depth=args.depth)
    model = TinyDecoder(cfg)
    total_params = sum(p.numel() * p.element_size() for p in model.parameters())
    per_block = sum(p.numel() for p in model.blocks[0].parameters())
    config = DistributedConfig(
        fsdp_auto_wrap_min_params=per_block,
        fsdp_mixed_precision=PrecisionRules(rules=(Glob("*norm.weight"), Glob("*router.weight"))),
    )
    wrap_model_for_training(model, config)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq + 1))
    model.loss(tokens).backward()
    optim.step()
    params = local_bytes(model.parameters())
    state = local_bytes(
        v
        for s in optim.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    stats = torch.tensor([params, state], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(
                {
                    "world": world,
                    "total_param_bytes": total_params,
                    "max_rank_param_bytes": int(stats[0]),
                    "max_rank_optim_bytes": int(stats[1]),
                },
                f,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (CI)")
    args = parser.parse_args()
    if args.smoke:
        args.world_sizes, args.dim, args.depth = [1, 2], 16, 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for world in args.world_sizes:
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            launch(worker, (world, args, tmp.name), nproc=world)
            with open(tmp.name) as f:
                rows.append(json.load(f))
    print(
        "| world size | params per rank (max) | ideal (total / world) | efficiency "
        "| AdamW state per rank (max) | ideal (2 x fp32 params / world) |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        ideal = r["total_param_bytes"] / r["world"]
        ideal_state = 2 * r["total_param_bytes"] / r["world"]
        print(
            f"| {r['world']} | {r['max_rank_param_bytes']:,} | {ideal:,.0f} | "
            f"{ideal / r['max_rank_param_bytes']:.3f} | {r['max_rank_optim_bytes']:,} "
            f"| {ideal_state:,.0f} |"
        )


if __name__ == "__main__":
    main()
