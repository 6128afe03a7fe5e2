"""``fsdp-precision plan MODEL``: the precision plan of a model, before any GPU hour is spent."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from fsdp_precision._config import DistributedConfig
from fsdp_precision._memory import memory_per_rank
from fsdp_precision._rules import Glob
from fsdp_precision._wrap import plan_model_for_training

from ._models import load_model

__all__ = ["PlanOptions", "run_plan"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    model: str
    world_size: int = 8
    precision: str = "bf16"
    min_params: int = 10_000_000
    rules: tuple[str, ...] = ()
    as_json: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"--world-size must be >= 1, got {self.world_size}")
        if self.min_params < 0:
            raise ValueError(f"--min-params must be >= 0, got {self.min_params}")


def _parse_rule(text: str) -> Glob:
    """``--keep GLOB[=DTYPE]``: a :class:`Glob` rule (fp32 when no dtype is given)."""
    pattern, _, dtype = text.partition("=")
    dtype = dtype or "fp32"
    if dtype not in _DTYPES:
        raise ValueError(f"--keep {text!r}: dtype {dtype!r} is not one of fp32, bf16, fp16")
    return Glob(pattern, _DTYPES[dtype])


def run_plan(opts: PlanOptions) -> int:
    model = load_model(opts.model)
    config = DistributedConfig(
        fsdp_mixed_precision=opts.precision,  # type: ignore[arg-type]
        fsdp_auto_wrap_min_params=opts.min_params,
        precision_rules=tuple(_parse_rule(r) for r in opts.rules),
    )
    plan = plan_model_for_training(model, config, world_size=opts.world_size)
    memory = memory_per_rank(plan)
    if opts.as_json:
        data = plan.to_dict()
        data["memory_per_rank_bytes"] = memory
        print(json.dumps(data, indent=2))
        return 0
    print(plan.explain())
    gib = 1024**3
    total = sum(memory.values())
    print(
        f"\nmemory per rank at world size {opts.world_size} (AdamW, before activations): "
        + ", ".join(f"{k} {v / gib:,.2f} GiB" for k, v in memory.items())
        + f"; total {total / gib:,.2f} GiB"
    )
    return 0
