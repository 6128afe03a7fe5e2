"""torch's own policy, as accelerate's FSDP2 plugin and the Trainer apply it by default: every unit
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; the kept parameters compute in bf16
like the rest (the baseline every other peer is timed against)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

NAME = "torch_uniform"
SOURCE = f"torch {torch.__version__}: MixedPrecisionPolicy(bf16, fp32) on every unit"


def available() -> str | None:
    return None


def wrap(model: nn.Module, kept: tuple[str, ...]) -> str:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return ""
