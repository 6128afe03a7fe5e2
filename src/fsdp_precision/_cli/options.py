"""Options the commands share: ``--keep GLOB[=DTYPE]`` rules and the ``--precision`` preset."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fsdp_precision._plan.rules import Glob, ModuleClass, PrecisionRules
from fsdp_precision._train.config import PRESETS

__all__ = ["DTYPES", "parse_keep", "precision_rules"]

#: ``--keep`` dtype names.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_keep(text: str) -> Glob:
    """``--keep GLOB[=DTYPE]``: a :class:`Glob` rule (fp32 when no dtype is given)."""
    pattern, _, dtype = text.partition("=")
    dtype = dtype or "fp32"
    if dtype not in DTYPES:
        raise ValueError(f"--keep {text!r}: dtype {dtype!r} is not one of fp32, bf16, fp16")
    return Glob(pattern, DTYPES[dtype])


def precision_rules(
    preset: str, keep: Iterable[str], extra: Iterable[Glob | ModuleClass] = ()
) -> PrecisionRules:
    """The ``--precision`` preset with the ``--keep`` rules first, then ``extra``."""
    if preset not in PRESETS:
        raise ValueError(f"--precision must be one of {', '.join(PRESETS)}, got {preset!r}")
    param_dtype, reduce_dtype = PRESETS[preset]
    rules = (*(parse_keep(k) for k in keep), *extra)
    return PrecisionRules(param_dtype=param_dtype, reduce_dtype=reduce_dtype, rules=rules)
