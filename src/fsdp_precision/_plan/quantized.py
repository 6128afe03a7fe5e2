"""Quantized parameters: packed storage whose bits are not numbers of their dtype, and weights
that all-gather in a format of their own.

bitsandbytes' 4-bit weights (``Params4bit``, QLoRA) pack two 4-bit codes per byte into a tensor
of the ``bnb_4bit_quant_storage`` dtype; ``Linear4bit`` dequantizes them with the quant state it
keeps on the module, which survives FSDP2's parameter swap. With a floating storage dtype
(bf16, fp16, fp32: what FSDP needs to shard them with the rest) a ``param_dtype`` cast reads the
packed codes as numbers: fp32 storage then fails in bitsandbytes, fp16 storage under a bf16 policy
silently computes with other weights (plain ``MixedPrecisionPolicy`` does the same). So such a
parameter is always gathered in its storage dtype: the plan claims it before any user rule.

Non-floating storage (``uint8``, the default) is never cast by FSDP (torch 2.12+ clamps
``param_dtype`` for it). torch 2.11 cannot manage it at all: the refusal names ``ignored_params``.

A tensor subclass whose class defines FSDP2's ``fsdp_pre_all_gather`` (torchao's float8 training
weights) chooses what travels: ``param_dtype`` does not apply and no map can keep it in another
dtype (rules that claim one are refused). It sits beside kept parameters in one unit; FSDP packs
the unit's mixed all-gather inputs as bytes.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fsdp_precision._rules.rules import DeclaredRule

__all__ = ["PACKED_SOURCE", "gather_format", "is_packed", "packed_storage_rules", "wire_itemsize"]

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


#: (module prefix, class name) of weights that all-gather in their own format -> that format
#: and its bytes per element.
_OWN_FORMATS: dict[tuple[str, str], tuple[str, int]] = {
    ("torchao", "WeightWithDynamicFloat8CastTensor"): ("float8", 1),
}


def gather_format(param: torch.Tensor) -> str | None:
    """What ``param`` all-gathers as when its class does it itself (``"float8"`` for torchao's
    float8 weights, else the class name); ``None`` for ordinary parameters."""
    if not hasattr(param, "fsdp_pre_all_gather"):
        return None
    cls = type(param)
    for (package, name), (label, _) in _OWN_FORMATS.items():
        if cls.__module__.startswith(package) and cls.__name__ == name:
            return label
    return cls.__name__


def wire_itemsize(fmt: str) -> int | None:
    """Bytes per element of a :func:`gather_format`, where known."""
    return next((size for label, size in _OWN_FORMATS.values() if label == fmt), None)
