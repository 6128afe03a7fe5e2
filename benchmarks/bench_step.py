"""Step time and collectives per step of the patched path, measured side by side in one run.

    python benchmarks/bench_step.py [--nproc 2] [--iters 200] [--dim 64] [--depth 6] [--profile]
        [--smoke]

Seven copies of one TinyDecoder, one FSDP2 unit per block and the root, bf16 compute, fp32 reduce:

- ``unpatched``: torch's own ``MixedPrecisionPolicy(bf16, fp32)``, wrapped and stepped with the
  patch removed (it is removed and re-applied around each of its steps, outside the timed region);
- ``empty_map``: the patch applied, ``ParamDtypeMixedPrecisionPolicy`` with an empty map;
- ``uniform``: the patch applied, torch's own uniform policy;
- ``mapped``: norms and routers mapped to fp32 inside their bf16 units
  (``compile_param_dtype_maps(...).apply()``);
- ``separate``: the public-API alternative, norms and routers as separate fp32 units;
- ``math_uniform`` and ``math_mapped``: no FSDP at all, the unsharded model computing as the
  uniform and the mapped units do (``verify_parity``'s reference: each parameter in its compute
  dtype, the units' casts, the routers' boundary casts). Their ratio is what the mapped model's
  different math costs (fp32 norms and routers, the casts), so that ``mapped / uniform`` divided
  by it is what the patch's mixed-dtype path itself costs.

Every iteration steps every variant once, in an order reversed every other iteration, so machine
noise hits all of them alike; a step's time is its slowest rank's. The ratios are medians over
iterations of (variant step / reference step in the same iteration). Collectives of one training
step are recorded for every variant, with the mapped model's all-gathered bytes against their
lower bound (every parameter once per unshard in its compute dtype, no padding).

Each ratio also gets the geometric mean over iterations and its 95% confidence interval (a
normal interval on the log ratios: with the default 200 pairs it resolves about 1%).
``--profile``: instead of timing, cProfile each variant's steps (rank 0) and report, per step,
the self time spent in ``fsdp_precision``'s functions and the largest of them: what the patch
itself costs in Python.

``--smoke``: a tiny model and two iterations, the same code path, in seconds. Prints JSON (rank 0)
and writes it to ``--out`` when given.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import date
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fsdp_precision as fp
from fsdp_precision._verify.reference import Reference  # verify_parity's unsharded model
from fsdp_precision.testing import (
    CollectiveRecorder,
    TinyConfig,
    TinyDecoder,
    launch,
    process_group,
    wrap_separate_units,
)

BF16, FP32 = torch.bfloat16, torch.float32
RULES = fp.PrecisionRules(
    param_dtype=BF16,
    reduce_dtype=FP32,
    rules=(fp.Glob("*norm.weight", FP32), fp.Glob("*router.weight", FP32)),
    advice="off",
)
VARIANTS = (
    "unpatched",
    "empty_map",
    "uniform",
    "mapped",
    "separate",
    "math_uniform",
    "math_mapped",
)
#: (variant, reference) pairs whose per-iteration step-time ratios are reported.
RATIOS = (
    ("empty_map", "unpatched"),
    ("uniform", "unpatched"),
    ("mapped", "uniform"),
    ("separate", "uniform"),
    ("math_mapped", "math_uniform"),
)


def wrap_uniform(model: TinyDecoder, policy: MixedPrecisionPolicy) -> None:
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def build(base: TinyDecoder) -> dict[str, tuple[TinyDecoder, fp.PrecisionPlan | None]]:
    """The five wrapped copies of ``base`` (the mapped ones with their plans)."""
    models = {k: copy.deepcopy(base) for k in VARIANTS}
    uniform = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    fp.remove_param_dtype_map_patch()
    wrap_uniform(models["unpatched"], uniform)
    fp.apply_param_dtype_map_patch()
    wrap_uniform(
        models["empty_map"], fp.ParamDtypeMixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    )
    wrap_uniform(models["uniform"], uniform)
    mapped = fp.compile_param_dtype_maps(models["mapped"], RULES)
    mapped.apply()
    separate = fp.compile_param_dtype_maps(models["separate"], RULES)
    wrap_separate_units(models["separate"], separate)
    plans = {"mapped": mapped, "separate": separate}
    uniform_rules = fp.PrecisionRules(param_dtype=BF16, reduce_dtype=FP32, advice="off")
    for name, rules in (("math_uniform", uniform_rules), ("math_mapped", RULES)):
        models[name] = Reference(fp.compile_param_dtype_maps(models[name], rules)).module
    return {k: (m, plans.get(k)) for k, m in models.items()}


def step_fn(model: TinyDecoder, cfg: TinyConfig, unpatched: bool) -> Callable[[], float]:
    """One timed training step (forward, backward, AdamW); unpatched: with the patch removed."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, cfg.vocab, (4, cfg.seq + 1), generator=g)

    def step() -> float:
        if unpatched:
            fp.remove_param_dtype_map_patch()
        try:
            start = time.perf_counter()
            model.loss(tokens).backward()
            opt.step()
            opt.zero_grad()
            return time.perf_counter() - start
        finally:
            if unpatched:
                fp.apply_param_dtype_map_patch()

    return step


def synced(step: Callable[[], float]) -> float:
    dist.barrier()
    t_max = torch.tensor([step()])
    dist.all_reduce(t_max, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    return float(t_max.item())


def lower_bound_bytes(plan: fp.PrecisionPlan) -> int:
    """One step's all-gathered bytes with no padding: every parameter in its compute dtype, once
    per unshard (blocks twice, forward and backward; the root, never resharded, once)."""
    total = 0
    for unit in plan.units:
        unit_bytes = sum(
            math.prod(p.shape) * torch.empty((), dtype=p.compute).element_size()
            for p in unit.params
        )
        total += unit_bytes * (1 if plan.model in unit.modules else 2)
    return total


def check_contract(collectives: dict[str, dict[str, int]]) -> None:
    """Fail the run where the patch broke its contract: an empty map takes the upstream path
    (the same collectives), and a map costs no extra collective."""
    if collectives["empty_map"] != collectives["unpatched"]:
        raise SystemExit(f"empty map != unpatched: {collectives}")
    counts = {k: (c["all_gathers"], c["reduce_scatters"]) for k, c in collectives.items()}
    if counts["mapped"] != counts["uniform"]:
        raise SystemExit(f"mapped units issue other collectives than uniform ones: {counts}")


def confidence(ratios: list[float]) -> dict[str, float]:
    """Geometric mean of paired ratios and its 95% interval (normal, on the log ratios)."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    half = (
        statistics.NormalDist().inv_cdf(0.975) * statistics.stdev(logs) / math.sqrt(len(logs))
        if len(logs) > 1
        else math.inf
    )
    return {"geomean": math.exp(mean), "ci95_low": math.exp(mean - half),
            "ci95_high": math.exp(mean + half), "pairs": len(logs)}  # fmt: skip


def profile(steps: dict[str, Callable[[], float]], n: int) -> dict[str, Any]:
    """Per step: total time, and self time in fsdp_precision's functions (the top five)."""
    import cProfile
    import pstats

    report: dict[str, Any] = {}
    for variant, step in steps.items():
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(n):
            step()
        profiler.disable()
        stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
        ours = [(f"{k[0].split('fsdp_precision/')[-1]}:{k[2]}", v[1], v[2])
                for k, v in stats.items() if "fsdp_precision/_" in k[0]]  # fmt: skip
        ours.sort(key=lambda row: -row[2])
        report[variant] = {
            "step_s": sum(v[2] for v in stats.values()) / n,
            "fsdp_precision_self_s": sum(row[2] for row in ours) / n,
            "top": [{"function": f, "calls": c // n, "self_s": t / n} for f, c, t in ours[:5]],
        }
    return report


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    with process_group(timeout_s=300):
        measure(dist.get_rank(), args)


def measure(rank: int, args: argparse.Namespace) -> None:
    cfg = TinyConfig(dim=args.dim, depth=args.depth)
    torch.manual_seed(0)
    built = build(TinyDecoder(cfg))
    steps = {k: step_fn(m, cfg, unpatched=k == "unpatched") for k, (m, _) in built.items()}

    for _ in range(args.warmup):  # lazy init and warm-up
        for k in VARIANTS:
            synced(steps[k])
    if args.profile:
        profiled = profile(steps, args.iters)
        if rank == 0:
            print(json.dumps({"profile_steps": args.iters, "profile": profiled}, indent=2))
        return
    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for i in range(args.iters):
        for k in reversed(VARIANTS) if i % 2 else VARIANTS:
            times[k].append(synced(steps[k]))

    collectives: dict[str, dict[str, int]] = {}
    for k in VARIANTS:
        with CollectiveRecorder() as rec:
            steps[k]()
        gathers = rec.of("all_gather")
        collectives[k] = {
            "all_gathers": len(gathers),
            "reduce_scatters": rec.count("reduce_scatter"),
            "all_gather_bytes": sum(g.output_bytes for g in gathers),
        }
    mapped_plan = built["mapped"][1]
    assert mapped_plan is not None
    check_contract({k: v for k, v in collectives.items() if not k.startswith("math_")})

    if rank == 0:
        ratios = {
            f"{a}_over_{b}": statistics.median(
                x / y for x, y in zip(times[a], times[b], strict=True)
            )
            for a, b in RATIOS
        }
        intervals = {
            f"{a}_over_{b}": confidence([x / y for x, y in zip(times[a], times[b], strict=True)])
            for a, b in RATIOS
        }
        overhead = ratios["mapped_over_uniform"] / ratios["math_mapped_over_math_uniform"]
        result: dict[str, Any] = {
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "date": date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
            "torch": torch.__version__,
            "backend": "gloo",
            "nproc": args.nproc,
            "iters": args.iters,
            "model": f"TinyDecoder dim={cfg.dim} depth={cfg.depth} seq={cfg.seq} batch=4",
            "median_step_s": {k: statistics.median(v) for k, v in times.items()},
            "median_paired_ratio": ratios,
            "paired_ratio_ci95": intervals,
            "mapped_path_overhead": overhead,
            "collectives_per_step": collectives,
            "mapped_all_gather_bytes_lower_bound": lower_bound_bytes(mapped_plan),
        }
        print(json.dumps(result, indent=2))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--out", default="")
    parser.add_argument("--profile", action="store_true", help="cProfile instead of timing")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (CI)")
    args = parser.parse_args()
    if args.smoke:
        args.iters, args.warmup, args.dim, args.depth = 2, 1, 16, 2
    launch(worker, (args,), nproc=args.nproc)


if __name__ == "__main__":
    main()
