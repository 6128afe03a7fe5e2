"""Options the commands share: ``--keep GLOB[=DTYPE]`` rules with their ``--boundary``, the
``--precision`` preset and the ``--units`` layout."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from fsdp_precision._plan.units import accelerate_units, auto_wrap_units, default_units
from fsdp_precision._policy.casts import BOUNDARIES, Boundary
from fsdp_precision._rules.rules import (
    ADVICE_MODES,
    MEASURED_THRESHOLD,
    AdviceMode,
    Glob,
    ModuleClass,
    PrecisionRules,
)
from fsdp_precision._train.config import PRESETS

__all__ = ["BOUNDARY_NAMES", "DTYPES", "UNITS", "parse_keep", "precision_rules", "units_of"]

#: ``--keep`` dtype names.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


#: ``--units`` layouts: what decides the ``fully_shard`` calls.
UNITS = ("size", "transformer_block", "accelerate")
#: ``--boundary`` values (``Glob(..., boundary=...)`` of every ``--keep`` rule).
BOUNDARY_NAMES: tuple[str, ...] = BOUNDARIES


def parse_keep(text: str, boundary: Boundary = "auto") -> Glob:
    """``--keep GLOB[=DTYPE]``: a :class:`Glob` rule (fp32 when no dtype is given)."""
    pattern, _, dtype = text.partition("=")
    dtype = dtype or "fp32"
    if dtype not in DTYPES:
        raise ValueError(f"--keep {text!r}: dtype {dtype!r} is not one of fp32, bf16, fp16")
    return Glob(pattern, DTYPES[dtype], boundary=boundary)


def precision_rules(
    preset: str,
    keep: Iterable[str],
    extra: Iterable[Glob | ModuleClass] = (),
    *,
    boundary: Boundary = "auto",
    advice: AdviceMode = "report",
    advice_threshold: float | None = None,
    uncast_inputs: tuple[str, ...] = (),
) -> PrecisionRules:
    """The ``--precision`` preset with the ``--keep`` rules (``--boundary``) first, then
    ``extra``; the advisor as ``--advice`` says (``--advice-threshold``: its measured
    threshold); ``--uncast-inputs``."""
    if preset not in PRESETS:
        raise ValueError(f"--precision must be one of {', '.join(PRESETS)}, got {preset!r}")
    if advice not in ADVICE_MODES:
        raise ValueError(f"--advice must be one of {', '.join(ADVICE_MODES)}, got {advice!r}")
    if advice_threshold is not None and advice != "measured":
        raise ValueError(
            f"--advice-threshold {advice_threshold} applies to --advice measured, but --advice is "
            f"{advice!r}: add --advice measured or drop --advice-threshold"
        )
    param_dtype, reduce_dtype = PRESETS[preset]
    rules = (*(parse_keep(k, boundary) for k in keep), *extra)
    try:
        return PrecisionRules(
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            rules=rules,
            advice=advice,
            advice_threshold=MEASURED_THRESHOLD if advice_threshold is None else advice_threshold,
            uncast_inputs=uncast_inputs,
        )
    except ValueError as exc:
        if "uncast_inputs" in str(exc):
            raise ValueError(f"--uncast-inputs: {exc}") from None
        if "advice_threshold" in str(exc):
            raise ValueError(f"--advice-threshold: {exc}") from None
        raise


def units_of(
    model: nn.Module, layout: str, *, min_params: int, example_inputs: object = None
) -> list[nn.Module | list[nn.Module]]:
    """The ``fully_shard`` calls of ``--units LAYOUT``: ``size`` (a module per ``min_params``,
    as ``wrap_model_for_training``), ``transformer_block`` (the ``_no_split_modules`` blocks,
    then the root) or ``accelerate`` (accelerate's FSDP2 transformer-based wrap)."""
    if layout == "size":
        return list(auto_wrap_units(model, min_params, example_inputs=example_inputs))
    if layout == "transformer_block":
        return list(default_units(model))
    if layout == "accelerate":
        return accelerate_units(model)
    raise ValueError(f"--units must be one of {', '.join(UNITS)}, got {layout!r}")
