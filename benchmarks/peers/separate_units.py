"""The public-API workaround: each module holding kept parameters its own FSDP2 unit with an fp32
policy (``param_dtype=None``, ``cast_forward_inputs``), the rest as the uniform policy; laid out
by the library's plan (``layout="separate_units"``), which makes the same calls a user would."""

from __future__ import annotations

import torch.nn as nn

import fsdp_precision as fp
from peers.library import rules

NAME = "separate_units"
SOURCE = "public FSDP2 API: fp32 child units (compile_param_dtype_maps(layout='separate_units'))"


def available() -> str | None:
    return None


def wrap(model: nn.Module, kept: tuple[str, ...]) -> str:
    units = [*model.model.layers, model]
    fp.compile_param_dtype_maps(model, rules(kept), units, layout="separate_units").apply()
    return ""
