"""The unsharded reference: a copy of ``plan.model`` that computes as the plan's FSDP units will.

It emulates exactly what FSDP does to numerics (see :mod:`fsdp_precision._verify.parity`):
parameters cast to their planned compute dtype with storage-dtype masters for the optimizer, each
unit's
inputs cast to its ``param_dtype`` (but those it leaves uncast) and outputs to its
``output_dtype``, grad-requiring inputs
through an identity autograd node, and gradients through the unit's ``reduce_dtype``. Where the
release defers the gradient upcast to the reduce-scatter (2.15, ``defers_grad_upcast``), the
compute-dtype parameters it concerns carry no ``grad_dtype``, as FSDP's unsharded ones do in
backward, so their gradients keep the dtype autograd produces.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from fsdp_precision._plan.plan import PrecisionPlan
from fsdp_precision._policy.casts import install_cast
from fsdp_precision._policy.inputs import argument_names, cast_inputs
from fsdp_precision._releases import release_traits

__all__ = ["Reference"]


def _cast_floating(dtype: torch.dtype | None) -> Callable[[Any], Any]:
    def cast(x: Any) -> Any:  # FSDP's _cast_fp_tensor
        if dtype is not None and isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(dtype) if x.dtype != dtype else x
        return x

    return cast


class _Identity(torch.autograd.Function):
    """FSDP routes each unit's grad-requiring inputs through an identity autograd node
    (``RegisterPostBackwardFunction``); the reference does the same so that gradients meeting
    from several uses are summed in the same order."""

    @staticmethod
    def forward(ctx: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return grads


def _pre_forward(
    cast_to: torch.dtype | None, identity: bool, module: nn.Module, uncast: frozenset[str]
) -> Callable[..., Any]:
    cast = _cast_floating(cast_to)
    positional = argument_names(module)[0]

    def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
        if cast_to is not None and uncast:  # the unit's cast leaves these inputs alone
            args, kwargs = cast_inputs(positional, args, kwargs, cast_to, uncast)
        else:
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        if not identity or not torch.is_grad_enabled():
            return args, kwargs
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if idx:
            outs = _Identity.apply(*(flat[i] for i in idx))  # type: ignore[no-untyped-call]
            for i, out in zip(idx, outs, strict=True):
                flat[i] = out
        return tree_unflatten(flat, spec)

    return hook


def _post_forward(output_dtype: torch.dtype) -> Callable[..., Any]:
    cast = _cast_floating(output_dtype)

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        return tree_map(cast, output)

    return hook


def _defer_grad_upcast(module: nn.Module, plan: PrecisionPlan) -> None:
    """Clear ``grad_dtype`` where the release's ``pre_backward`` does (2.15,
    ``ReleaseTraits.defers_upcast``): autograd then leaves each such gradient in the dtype the
    backward produced instead of casting it to the compute dtype."""
    release = release_traits()
    deferred: set[str] = set()
    for unit in plan.units:
        for p in unit.params:
            grad_dtype = unit.policy.reduce_dtype or p.storage
            if p.reduce is not None and release.defers_upcast(grad_dtype, p.compute):
                deferred.update((p.fqn, *p.aliases))
    for fqn, param in module.named_parameters():
        if fqn in deferred:
            param.grad_dtype = None


class Reference:
    """An unsharded copy of ``plan.model`` that computes as the plan's FSDP units will.

    Build it *before* ``plan.apply()``. ``module`` computes with each parameter in its planned
    compute dtype; ``masters`` holds the storage-dtype copies the optimizer updates, keyed by
    FQN (the first alias of a tied parameter).
    """

    def __init__(self, plan: PrecisionPlan) -> None:
        model = plan.model
        self.plan = plan
        self.module: nn.Module = copy.deepcopy(model)
        planned = plan.params_by_fqn
        self.masters: dict[str, nn.Parameter] = {}
        with torch.no_grad():
            for fqn, param in self.module.named_parameters():  # one name per tied parameter
                storage = planned[fqn].storage  # upcast exactly where plan.apply() will
                self.masters[fqn] = nn.Parameter(
                    param.detach().to(storage, copy=True), requires_grad=param.requires_grad
                )
                compute = planned[fqn].compute
                if param.dtype != compute:
                    param.data = param.data.to(compute)
        _defer_grad_upcast(self.module, plan)
        names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        # The boundary casts of kept modules, as the construction step installs them; after the
        # unit hooks below, in the order FSDP's prepended hooks and the casts run.
        boundaries = [
            (self.module.get_submodule(f), c, unit.policy.param_dtype)
            for unit in plan.units
            for f, c in unit.module_casts.items()
        ]
        for unit in plan.units:
            policy = unit.policy
            casts = policy.cast_forward_inputs or bool(unit.uncast_inputs)
            cast = policy.param_dtype if casts else None
            for module in unit.modules:
                ref = self.module.get_submodule(names[id(module)])
                ref.register_forward_pre_hook(
                    _pre_forward(cast, bool(unit.params), ref, unit.uncast_inputs),
                    with_kwargs=True,
                )
                if policy.output_dtype is not None:
                    ref.register_forward_hook(_post_forward(policy.output_dtype))
        for kept, boundary, back in boundaries:
            install_cast(kept, boundary, back)

    def master_grads(self) -> dict[str, torch.Tensor | None]:
        """Each compute-dtype gradient through its reduce dtype into its storage dtype."""
        planned = self.plan.params_by_fqn
        grads: dict[str, torch.Tensor | None] = {}
        for fqn, param in self.module.named_parameters():
            p = planned[fqn]
            if param.grad is None or p.reduce is None:
                grads[fqn] = None
                continue
            grads[fqn] = param.grad.to(p.reduce).to(p.storage)
        return grads
