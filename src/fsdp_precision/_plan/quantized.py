"""Packed quantized storage: parameters whose bits are not numbers of their dtype.

bitsandbytes' 4-bit weights (``Params4bit``, QLoRA) pack two 4-bit codes per byte into a tensor
of the ``bnb_4bit_quant_storage`` dtype; ``Linear4bit`` dequantizes them with the quant state it
keeps on the module, which survives FSDP2's parameter swap. With a floating storage dtype
(bf16, fp16, fp32: what FSDP needs to shard them with the rest) a ``param_dtype`` cast reads the
packed codes as numbers: fp32 storage then fails in bitsandbytes, fp16 storage under a bf16 policy
silently computes with other weights (plain ``MixedPrecisionPolicy`` does the same). So such a
parameter is always gathered in its storage dtype: the plan claims it before any user rule.

Non-floating storage (``uint8``, the default) is never cast by FSDP (torch 2.12+ clamps
``param_dtype`` for it). torch 2.11 cannot manage it at all: the refusal names ``ignored_params``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fsdp_precision._plan.rules import DeclaredRule

__all__ = ["PACKED_SOURCE", "is_packed", "packed_storage_rules"]

#: The ``source`` of the rules that keep packed storage as it is (shown by ``explain()``).
PACKED_SOURCE = "packed quantized storage (never cast)"
#: (module prefix, class name) of the parameter classes that hold packed codes.
_PACKED_CLASSES = (("bitsandbytes", "Params4bit"),)


def is_packed(param: torch.Tensor) -> bool:
    """Whether ``param`` holds packed quantized codes (bitsandbytes ``Params4bit``)."""
    cls = type(param)
    return any(
        cls.__module__.startswith(package) and cls.__name__ == name
        for package, name in _PACKED_CLASSES
    )


def packed_storage_rules(model: nn.Module) -> tuple[DeclaredRule, ...]:
    """One rule per floating storage dtype of ``model``'s packed parameters, keeping each in its
    storage dtype (empty for models without any, and for non-floating storage)."""
    by_dtype: dict[torch.dtype, set[str]] = {}
    classes: dict[torch.dtype, set[str]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        if is_packed(param) and param.dtype.is_floating_point:
            by_dtype.setdefault(param.dtype, set()).add(fqn)
            classes.setdefault(param.dtype, set()).add(type(param).__name__)
    return tuple(
        DeclaredRule(
            source=PACKED_SOURCE,
            pattern=", ".join(sorted(classes[dtype])),
            fqns=frozenset(fqns),
            dtype=dtype,
        )
        for dtype, fqns in by_dtype.items()
    )
