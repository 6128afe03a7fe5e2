"""Parity of real architectures, wrapped by a compiled plan, against an unsharded reference.

The check itself is the library's (:func:`fsdp_precision.testing.verify_parity`, which the
``fsdp-precision verify`` command runs too): a reference that computes as FSDP does, identical
inputs on every rank, one forward, backward and AdamW step, bitwise comparisons of the output,
the loss, every gradient and every parameter after the step, and the dtype each parameter was
all-gathered in. This module adds what the tests know about each architecture: which parameters
its keep-in-fp32 declarations must claim.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_map

from fsdp_precision import PrecisionRules, compile_param_dtype_maps, hf
from fsdp_precision.testing import verify_parity

from tests.support.hf_models import ARCHS, wan_model

fp32 = torch.float32


def run_arch(name: str, *, stored_low: bool, autocast: torch.dtype | None = None) -> None:
    """``stored_low``: the model is stored in the arch dtype with kept tensors in fp32 (what
    ``from_pretrained(dtype=...)`` gives); else fp32 master weights with a low compute dtype."""
    arch = ARCHS[name] if name != "wan" else wan_model()
    torch.manual_seed(0)
    try:
        model = arch.build()
    except ImportError as exc:  # e.g. Afmoe is newer than transformers 4.x
        pytest.skip(f"{name} is not in this transformers release: {exc}")
    declared = set().union(*(d.params for d in hf.keep_in_fp32_declarations(model, arch.dtype)))
    if not declared:
        pytest.skip(f"{type(model).__name__} declares no keep-in-fp32 list in this release")
    if stored_low:
        hf.cast_keeping_fp32(model, arch.dtype)
    rules = PrecisionRules(param_dtype=None if stored_low else arch.dtype, reduce_dtype=fp32)
    plan = compile_param_dtype_maps(model, rules)
    kept = {p.fqn for u in plan.units for p in u.params if p.claimed}
    assert kept == declared, sorted(kept ^ declared)
    assert all(any(k in f for k in arch.kept) for f in kept), sorted(kept)

    inputs = arch.inputs(torch.Generator().manual_seed(0))  # the same on every rank
    if stored_low:  # a model stored in low precision is fed low-precision activations
        inputs = tree_map(
            lambda x: (
                x.to(arch.dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            ),
            inputs,
        )
    context = (lambda: torch.autocast("cpu", dtype=autocast)) if autocast is not None else None
    report = verify_parity(plan, inputs, context=context)
    assert report.ok, (name, report.problems()[:8])
    assert report.grads_bitwise_expected
    for p in report.params:
        assert p.gathered == p.compute, (name, p.fqn, p.gathered, p.compute)
        if p.fqn in kept:
            assert p.compute == fp32, (name, p.fqn, p.compute)
