"""fsdp-precision: the kept parameters mapped to fp32 inside the same units (one all-gather and one
reduce-scatter per unit), their modules given the boundary cast training needs."""

from __future__ import annotations

import torch
import torch.nn as nn

import fsdp_precision as fp

NAME = "fsdp_precision"
SOURCE = f"fsdp-precision {fp.__version__}: compile_param_dtype_maps(...).apply(), in-unit"


def available() -> str | None:
    return None


def rules(kept: tuple[str, ...]) -> fp.PrecisionRules:
    return fp.PrecisionRules(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        rules=tuple(fp.Glob(k) for k in kept),
        hf_keep_in_fp32=False,
        advice="off",
    )


def wrap(model: nn.Module, kept: tuple[str, ...]) -> str:
    fp.compile_param_dtype_maps(model, rules(kept), [*model.model.layers, model]).apply()
    return ""
