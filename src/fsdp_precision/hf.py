"""Hugging Face transformers and Diffusers: keep-in-fp32 declarations, keep-aware casts, loading.

>>> from fsdp_precision import hf
>>> hf.keep_in_fp32_declarations(model, torch.bfloat16)  # doctest: +SKIP
>>> hf.cast_keeping_fp32(model, torch.bfloat16)          # what from_pretrained(dtype=bf16) keeps
>>> hf.load_state_dict_aligned(model, state_dict)        # each tensor cast to its destination

The semantics follow the installed library (see ``docs/rules.md``): ``_keep_in_fp32_modules``
applies at fp16, ``_keep_in_fp32_modules_strict`` at fp16 and bf16, Diffusers'
``_keep_in_fp32_modules`` at any low-precision dtype; declarations are read from the library
model wherever it sits in the module tree and matched on the keys ``from_pretrained`` loads.
"""

from __future__ import annotations

from fsdp_precision._hf.cast import (
    cast_keeping_fp32,
    keep_in_fp32_declarations,
    kept_fqns,
    load_state_dict_aligned,
)
from fsdp_precision._hf.declarations import Declaration, library_of

__all__ = [
    "Declaration",
    "cast_keeping_fp32",
    "keep_in_fp32_declarations",
    "kept_fqns",
    "library_of",
    "load_state_dict_aligned",
]
