"""Hugging Face transformers and Diffusers: keep-in-fp32 declarations, keep-aware casts, loading.

>>> from fsdp_precision import hf
>>> hf.keep_in_fp32_declarations(model, torch.bfloat16)  # doctest: +SKIP
>>> hf.cast_keeping_fp32(model, torch.bfloat16)          # what from_pretrained(dtype=bf16) keeps
>>> hf.cast_keeping_fp32(model, torch.bfloat16, rules=rules)  # and what your rules keep
>>> hf.load_state_dict_aligned(model, state_dict)        # each tensor cast to its destination

The semantics follow the installed library (see ``docs/rules.md``): ``_keep_in_fp32_modules``
applies at fp16, ``_keep_in_fp32_modules_strict`` at fp16 and bf16, Diffusers'
``_keep_in_fp32_modules`` at any low-precision dtype; declarations are read from the library
model wherever it sits in the module tree and matched on the keys ``from_pretrained`` loads.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fsdp_precision._hf import cast as _cast
from fsdp_precision._hf.cast import keep_in_fp32_declarations, kept_fqns, load_state_dict_aligned
from fsdp_precision._hf.declarations import Declaration, library_of
from fsdp_precision._plan.claims import claim_params, fqns_by_param
from fsdp_precision._rules.rules import PrecisionRules

__all__ = [
    "Declaration",
    "cast_keeping_fp32",
    "keep_in_fp32_declarations",
    "kept_fqns",
    "library_of",
    "load_state_dict_aligned",
]


def cast_keeping_fp32(
    model: nn.Module, dtype: torch.dtype, *, rules: PrecisionRules | None = None
) -> nn.Module:
    """Give ``model`` the storage ``from_pretrained(dtype=dtype)`` produces, tensor by tensor,
    and keep what ``rules`` keep.

    Floating parameters and persistent buffers are cast to ``dtype``, except the model's
    declared keeps, which stay in fp32 with every alias of a tied kept tensor (unlike
    ``model.to(dtype)``, which undoes the declarations). Non-persistent buffers, which
    ``from_pretrained`` never loads, get the dtype the model's class makes them in with
    ``dtype`` as the default dtype, as under ``from_pretrained`` (rotary ``inv_freq``, made with
    ``.float()``, stays fp32; Gemma's ``embed_scale`` goes to ``dtype``), in declared modules
    too; those of modules whose parameters ``rules`` keep, and of a model whose class cannot be
    rebuilt from its config on meta, keep their dtype.
    Declarations follow the installed library, through wrappers (a ``PeftModel``) and tie
    targets.

    ``rules``: the :class:`~fsdp_precision.PrecisionRules` you will plan with; every parameter
    a user rule claims stays in the rule's dtype (when wider than ``dtype``), so the plan finds
    nothing lost. Call it on an fp32 model (build or load it in fp32). In place; returns
    ``model``; tied tensors stay tied.
    """
    if rules is not None and not isinstance(rules, PrecisionRules):
        raise TypeError(f"rules must be a PrecisionRules, got {type(rules).__name__}")
    keep: dict[str, torch.dtype] = {}
    if rules is not None and rules.rules:
        fqns_of = fqns_by_param(model)
        claimed, _ = claim_params(model, rules, (), fqns_of)
        for pid, (kept, rule) in claimed.items():
            if rule in rules.rules and kept.itemsize > dtype.itemsize:
                keep[fqns_of[pid][0]] = kept
    return _cast.cast_keeping_fp32(model, dtype, keep=keep)
