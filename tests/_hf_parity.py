"""Parity of real architectures, wrapped by a compiled plan, against an unsharded reference.

The reference emulates exactly what FSDP does to numerics: each parameter cast to its planned
compute dtype, and each unit's floating inputs cast to the unit's ``param_dtype`` (FSDP's
``cast_forward_inputs``). Inputs are identical on every rank, so the averaged gradient equals
the reference gradient bitwise.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from _hf_models import ARCHS, wan_model
from fsdp_precision import PrecisionRules, compile_param_dtype_maps, hf
from fsdp_precision._observe import GatherProbe

fp32 = torch.float32


class _Identity(torch.autograd.Function):
    """FSDP routes each unit's grad-requiring inputs through an identity autograd node
    (RegisterPostBackwardFunction); the reference does the same so that gradients that meet
    from several uses are summed in the same order."""

    @staticmethod
    def forward(ctx: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return grads


def _unit_boundary_hook(dtype: torch.dtype | None):
    def cast(x: Any) -> Any:
        if dtype is not None and isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(dtype) if x.dtype != dtype else x
        return x

    def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
        args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if idx and torch.is_grad_enabled():
            outs = _Identity.apply(*(flat[i] for i in idx))
            for i, out in zip(idx, outs, strict=True):
                flat[i] = out
        return tree_unflatten(flat, spec)

    return hook


def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple):
        return out[0]
    return out.logits if getattr(out, "logits", None) is not None else out.sample


def run_arch(name: str, *, stored_low: bool, autocast: bool = False) -> None:
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
    ref = copy.deepcopy(model)
    rules = PrecisionRules(param_dtype=None if stored_low else arch.dtype, reduce_dtype=fp32)
    plan = compile_param_dtype_maps(model, rules)
    kept = {p.fqn for u in plan.units for p in u.params if p.rule != "default"}
    assert kept == declared, sorted(kept ^ declared)
    assert all(any(k in f for k in arch.kept) for f in kept), sorted(kept)
    compute = {}
    for unit in plan.units:
        for p in unit.params:
            for fqn in (p.fqn, *p.aliases):
                compute[fqn] = p.compute
    plan.apply()

    with torch.no_grad():
        for fqn, param in ref.named_parameters():
            if param.dtype != compute[fqn]:
                param.data = param.data.to(compute[fqn])
    for unit in plan.units:
        cast = unit.policy.param_dtype if unit.policy.cast_forward_inputs else None
        for module in unit.modules:
            name_ = next(n for n, m in model.named_modules() if m is module)
            ref.get_submodule(name_).register_forward_pre_hook(
                _unit_boundary_hook(cast), with_kwargs=True
            )

    inputs = arch.inputs(torch.Generator().manual_seed(0))  # the same on every rank
    if stored_low:  # a model stored in low precision is fed low-precision activations
        inputs = tree_map(
            lambda x: (
                x.to(arch.dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            ),
            inputs,
        )
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with GatherProbe(model) as probe, context:
        out = model(**inputs)
    with context:
        ref_out = ref(**inputs)
    logits, ref_logits = _logits(out), _logits(ref_out)
    assert logits.dtype == ref_logits.dtype and torch.equal(logits, ref_logits), name
    loss = out.loss if getattr(out, "loss", None) is not None else logits.float().pow(2).mean()
    ref_loss = (
        ref_out.loss
        if getattr(ref_out, "loss", None) is not None
        else ref_logits.float().pow(2).mean()
    )
    assert torch.equal(loss, ref_loss), (name, loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    for (fqn, p), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if r.grad is None:
            assert p.grad is None, fqn
            continue
        got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        expected = r.grad.to(fp32).to(p.dtype)
        assert got.dtype == p.dtype and torch.equal(got, expected), (
            name,
            fqn,
            (got.float() - expected.float()).abs().max().item(),
            expected.abs().max().item(),
        )
    for fqn, seen in probe.seen.items():
        want = fp32 if fqn in kept else compute[fqn]
        assert seen.dtype == want, (name, fqn, seen.dtype, want)
        assert not seen.sharded, fqn
