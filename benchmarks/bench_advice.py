"""What the precision advisor costs the plan: full-size models on the meta device, side by side.

    python benchmarks/bench_advice.py [--models deepseek_v3 qwen3_moe] [--iters 5] [--smoke]

For each model (built from its transformers config class on the meta device: no memory, no
compute), each iteration times, in an order reversed every other iteration:

- ``off``: ``compile_param_dtype_maps(model, PrecisionRules(advice="off"), units)`` and
  ``explain()``;
- ``report``: the same with ``advice="report"`` (the default): ``explain()`` then traces one
  forward and lists the advice;
- ``advise``: ``fsdp_precision.advise(model)`` alone.

The units are the model's decoder layers, then the root. Ratios are medians over iterations of
(report / off in the same iteration). ``--smoke``: a tiny config of each model, one iteration,
the same code path. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import warnings
from typing import Any

import torch
import torch.nn as nn

import fsdp_precision as fp

VARIANTS = ("off", "report", "advise")


def build(model_type: str, smoke: bool) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp_precision.testing import tiny_config

    config = AutoConfig.for_model(model_type)
    if smoke:
        config = tiny_config(config)
        config.use_cache = True  # as the full config: a meta forward needs the cache path
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def run_once(model: nn.Module, variant: str) -> tuple[float, int]:
    """Seconds for one variant, and how many parameters the advice names."""
    units = [*model.get_submodule("model.layers"), model]
    start = time.perf_counter()
    if variant == "advise":
        found = len(fp.advise(model).params())
    else:
        plan = fp.compile_param_dtype_maps(
            model,
            fp.PrecisionRules(advice=variant),
            units,  # type: ignore[arg-type]
        )
        plan.explain()
        found = len(plan.advice.params()) if plan.advice is not None else 0
    return time.perf_counter() - start, found


def bench(model_type: str, iters: int, smoke: bool) -> dict[str, Any]:
    model = build(model_type, smoke)
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    found: dict[str, int] = {}
    for i in range(iters):
        for variant in VARIANTS if i % 2 == 0 else tuple(reversed(VARIANTS)):
            took, found[variant] = run_once(model, variant)
            seconds[variant].append(took)
    ratios = [r / o for r, o in zip(seconds["report"], seconds["off"], strict=True)]
    return {
        "model": model_type,
        "parameters": sum(p.numel() for p in model.parameters()),
        "median_seconds": {v: statistics.median(s) for v, s in seconds.items()},
        "report_over_off_median": statistics.median(ratios),
        "report_over_off_range": [min(ratios), max(ratios)],
        "advised_parameters": found["report"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["deepseek_v3", "qwen3_moe"])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    iters = 1 if args.smoke else args.iters
    results = [bench(m, iters, args.smoke) for m in args.models]
    if not all(r["advised_parameters"] > 0 for r in results):
        raise SystemExit(f"the advice named no parameter: {results}")
    print(
        json.dumps(
            {
                "torch": torch.__version__,
                "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
                "iters": iters,
                "smoke": args.smoke,
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
