"""``fsdp-precision plan MODEL``: the precision plan of a model, before any GPU hour is spent."""

from __future__ import annotations

import json
from dataclasses import dataclass

from fsdp_precision._cli.models import load_model
from fsdp_precision._cli.options import precision_rules
from fsdp_precision._plan.memory import memory_per_rank
from fsdp_precision._train.config import DistributedConfig
from fsdp_precision._train.wrap import plan_model_for_training

__all__ = ["PlanOptions", "run_plan"]


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


def run_plan(opts: PlanOptions) -> int:
    model = load_model(opts.model)
    config = DistributedConfig(
        fsdp_mixed_precision=precision_rules(opts.precision, opts.rules),
        fsdp_auto_wrap_min_params=opts.min_params,
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
