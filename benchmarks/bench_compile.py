"""Compiled blocks with kept parameters: step time, graph breaks and compile time, side by side.

    python benchmarks/bench_compile.py [--nproc 2] [--iters 20] [--dim 128] [--depth 4]
        [--backend inductor] [--smoke]

Three copies of one TinyDecoder (norms and routers kept in fp32), one FSDP2 unit per block and
the root, bf16 compute, fp32 reduce, every block ``module.compile``d (``--backend``, inductor by
default, on CPU):

- ``uniform``: torch's ``MixedPrecisionPolicy(bf16, fp32)``: norms and routers lose precision;
- ``in_unit``: the kept parameters mapped inside their blocks' units
  (``compile_param_dtype_maps(...).apply()``);
- ``separate``: the public-API layout, each norm and router its own fp32 unit inside its block
  (``layout="separate_units"``): FSDP's hooks break each compiled block at every such unit.

The first step of each (dynamo and the backend compile the blocks) is timed apart as the compile
time; graph breaks are dynamo's counters over that step. Then every iteration steps every
variant once, in an order reversed every other iteration; a step's time is its slowest rank's;
ratios are medians over iterations of (variant / uniform in the same iteration).
``--smoke``: a tiny model, aot_eager, two iterations, the same code path. Prints JSON (rank 0).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import date

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fsdp_precision as fp
from fsdp_precision.testing import TinyConfig, TinyDecoder, launch, process_group

BF16, FP32 = torch.bfloat16, torch.float32
RULES = fp.PrecisionRules(rules=(fp.Glob("*norm.weight"), fp.Glob("*router.weight")), advice="off")
VARIANTS = ("uniform", "in_unit", "separate")


def wrapped(base: TinyDecoder, variant: str, backend: str) -> TinyDecoder:
    model = copy.deepcopy(base)
    units = [*model.blocks, model]
    if variant == "uniform":
        policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
        for unit in units:
            fully_shard(unit, mp_policy=policy)
    else:
        layout = "in_unit" if variant == "in_unit" else "separate_units"
        fp.compile_param_dtype_maps(model, RULES, units, layout=layout).apply()  # type: ignore[arg-type]
    for block in model.blocks:
        block.compile(backend=backend)
    return model


def step_fn(model: TinyDecoder, cfg: TinyConfig) -> Callable[[], float]:
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


def synced(step: Callable[[], float]) -> float:
    dist.barrier()
    t_max = torch.tensor([step()])
    dist.all_reduce(t_max, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    return float(t_max.item())


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    with process_group(timeout_s=900):
        measure(args)


def measure(args: argparse.Namespace) -> None:
    cfg = TinyConfig(dim=args.dim, depth=args.depth)
    torch.manual_seed(0)
    base = TinyDecoder(cfg)
    steps, compile_s, breaks = {}, {}, {}
    for variant in VARIANTS:
        counters.clear()
        steps[variant] = step_fn(wrapped(base, variant, args.backend), cfg)
        compile_s[variant] = synced(steps[variant])  # the first step compiles
        breaks[variant] = sum(counters["graph_break"].values())
        graphs = counters["stats"]["unique_graphs"]
        synced(steps[variant])
        if counters["stats"]["unique_graphs"] != graphs:
            raise SystemExit(f"{variant}: recompiled on the second step")
    if breaks["in_unit"] != breaks["uniform"]:
        raise SystemExit(f"kept parameters added graph breaks: {breaks}")
    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for i in range(args.iters):
        for k in reversed(VARIANTS) if i % 2 else VARIANTS:
            times[k].append(synced(steps[k]))
    if dist.get_rank() == 0:
        ratios = {
            f"{k}_over_uniform": statistics.median(
                a / b for a, b in zip(times[k], times["uniform"], strict=True)
            )
            for k in ("in_unit", "separate")
        }
        print(
            json.dumps(
                {
                    "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                    "date": date.today().isoformat(),
                    "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                    "torch": torch.__version__,
                    "backend": args.backend,
                    "nproc": args.nproc,
                    "iters": args.iters,
                    "model": f"TinyDecoder dim={cfg.dim} depth={cfg.depth} seq={cfg.seq}",
                    "graph_breaks_first_step": breaks,
                    "first_step_s_compiling": compile_s,
                    "median_step_s": {k: statistics.median(v) for k, v in times.items()},
                    "median_paired_ratio": ratios,
                },
                indent=2,
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--backend", choices=("inductor", "aot_eager"), default="inductor")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, aot_eager (CI)")
    args = parser.parse_args()
    if args.smoke:
        args.iters, args.dim, args.depth, args.backend = 2, 16, 2, "aot_eager"
    launch(worker, (args,), nproc=args.nproc)


if __name__ == "__main__":
    main()
