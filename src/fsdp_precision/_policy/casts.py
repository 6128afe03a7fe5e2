"""Boundary casts of kept modules: a module whose parameters compute in another dtype than the
rest of its unit gets its floating inputs cast to that dtype, and (where it returns activations)
its floating outputs cast back to the unit's compute dtype: what a nested FSDP unit's
``cast_forward_inputs`` and ``output_dtype`` would do, without the nested unit.

Without them a mapped parameter meets activations of the unit's dtype: an fp32 router weight in
a bf16 unit fails ``F.linear(bf16 input, fp32 weight)`` ("expected m1 and m2 to have the same
dtype") unless the model casts for itself, and an fp32 norm weight turns the activations fp32
for the next bf16 matmul. Pure public torch: forward hooks on the module.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from fsdp_precision._base.dtypes import check_mappable_dtype, dtype_name, exact_upcast
from fsdp_precision._base.errors import ParamDtypeMapError

__all__ = [
    "BOUNDARIES",
    "Boundary",
    "ModuleCast",
    "cast_for",
    "cast_to",
    "install_cast",
    "installed_back",
    "installed_cast",
    "resolve_casts",
]

#: How a kept module meets the activations around it:
#: ``"auto"``: inputs cast to the kept dtype; outputs cast back to the unit's compute dtype when
#: the module only holds per-channel gains (every kept parameter 1-D or 0-D: norms, scales),
#: which return activations for the next matmul, or when it is not kept wider than the
#: activations; a module with a matrix kept wider (an fp32 router, T5's ``wo``) returns its
#: outputs in the kept dtype, as the models that compute routers in fp32 expect (the logits go
#: to softmax and top-k in fp32), except the modules known to return activations
#: (``fsdp_precision._hf.boundaries``: Llama 4's router);
#: ``"inputs"``; ``"inputs_outputs"``; ``"none"``: nothing, the module casts for itself.
Boundary = Literal["auto", "inputs", "inputs_outputs", "none"]
BOUNDARIES: tuple[Boundary, ...] = ("auto", "inputs", "inputs_outputs", "none")

_ATTR = "_fsdp_precision_cast"


@dataclass(frozen=True)
class ModuleCast:
    """The casts at one module's boundary.

    Attributes:
        inputs (torch.dtype): Floating tensors in the forward's arguments are cast to this dtype.
        outputs (bool): Floating tensors in the forward's output are cast back to the
            activations' dtype: the ``param_dtype`` of the ``fully_shard`` call that installs the
            cast, as a nested unit's ``output_dtype`` would (the dtype the first floating input
            came in, for a call with ``param_dtype=None``). (Default: ``False``)
    """

    inputs: torch.dtype
    outputs: bool = False

    def __post_init__(self) -> None:
        check_mappable_dtype(self.inputs, where="ModuleCast.inputs")
        if not isinstance(self.outputs, bool):
            raise ValueError(f"ModuleCast.outputs must be True or False, got {self.outputs!r}")

    def __str__(self) -> str:
        back = ", outputs cast back" if self.outputs else ""
        return f"inputs -> {dtype_name(self.inputs)}{back}"


def cast_for(
    boundary: Boundary,
    dtype: torch.dtype,
    params: Sequence[torch.Tensor],
    activation: torch.dtype,
    *,
    returns_activations: bool = False,
) -> ModuleCast | None:
    """The cast ``boundary`` asks for at a module whose ``params`` are kept in ``dtype`` among
    activations in ``activation``; ``returns_activations`` marks a module known to return
    activations though it holds a matrix (``fsdp_precision._hf.boundaries``)."""
    if boundary == "none":
        return None
    if boundary == "auto":
        gains = all(p.dim() <= 1 for p in params)
        back = gains or returns_activations or not exact_upcast(activation, dtype)
        return ModuleCast(dtype, outputs=back)
    return ModuleCast(dtype, outputs=boundary == "inputs_outputs")


def cast_to(dtype: torch.dtype) -> Any:
    """FSDP's ``_cast_fp_tensor`` to ``dtype``, for ``tree_map``."""

    def cast(x: Any) -> Any:  # FSDP's _cast_fp_tensor
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return cast


class _Hooks:
    """The pre- and post-forward hooks of one module's cast; a stack of incoming dtypes keeps
    nested or re-entrant calls (activation checkpointing's recompute) apart."""

    def __init__(self, cast: ModuleCast, back: torch.dtype | None) -> None:
        self.cast = cast
        self.back = back
        self.incoming: list[torch.dtype | None] = []

    def pre(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        leaves, _ = tree_flatten((args, kwargs))
        floating = [x for x in leaves if isinstance(x, torch.Tensor) and x.is_floating_point()]
        self.incoming.append(floating[0].dtype if floating else None)
        cast = cast_to(self.cast.inputs)
        return tree_map(cast, args), tree_map(cast, kwargs)

    def post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        incoming = self.incoming.pop() if self.incoming else None
        target = self.back or incoming
        if not self.cast.outputs or target is None:
            return output
        return tree_map(cast_to(target), output)


def install_cast(module: nn.Module, cast: ModuleCast, back: torch.dtype | None = None) -> bool:
    """Register ``cast``'s hooks on ``module``, outputs cast back to ``back`` (the call's
    ``param_dtype``; ``None``: the dtype the input came in). False, changing nothing, when it
    has one already."""
    if installed_cast(module) is not None:
        return False
    hooks = _Hooks(cast, back)
    module.register_forward_pre_hook(hooks.pre, with_kwargs=True)
    module.register_forward_hook(hooks.post, with_kwargs=True, always_call=True)
    setattr(module, _ATTR, hooks)
    return True


def installed_cast(module: nn.Module) -> ModuleCast | None:
    """The cast installed on ``module``, or None."""
    hooks = getattr(module, _ATTR, None)
    return hooks.cast if isinstance(hooks, _Hooks) else None


def installed_back(module: nn.Module) -> torch.dtype | None:
    """The dtype the installed cast returns outputs in (None: the dtype they came in, or no
    cast)."""
    hooks = getattr(module, _ATTR, None)
    return hooks.back if isinstance(hooks, _Hooks) else None


def incoming_dtype(module: nn.Module) -> torch.dtype | None:
    """The dtype the running forward of ``module`` came in, before its cast (None: no cast, or
    no forward running). A hook registered after the cast's reads it here: hooks run in
    registration order, and prepending one instead trips torch 2.11's dynamo, whose guards
    index a module's hooks in registration order."""
    hooks = getattr(module, _ATTR, None)
    return hooks.incoming[-1] if isinstance(hooks, _Hooks) and hooks.incoming else None


def resolve_casts(
    modules: Sequence[nn.Module], casts: Mapping[str, ModuleCast]
) -> tuple[tuple[nn.Module, ModuleCast], ...]:
    """The modules ``casts`` names under one ``fully_shard`` call's ``modules`` (a key reaches
    every member of a grouped call that has it). Raises :class:`ParamDtypeMapError` for a key
    that names no module of the call, with a did-you-mean."""
    found: dict[int, tuple[nn.Module, ModuleCast]] = {}
    names: list[str] = []
    for member in modules:
        named = dict(member.named_modules(remove_duplicate=False))
        names.extend(named)
        for key, cast in casts.items():
            module = named.get(key)
            if module is not None:
                found.setdefault(id(module), (module, cast))
    reached = {key for member in modules for key, _ in member.named_modules() if key in casts}
    for key in casts:
        if key not in reached:
            close = difflib.get_close_matches(key, [n for n in names if n], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ParamDtypeMapError(
                f"module_casts key {key!r} names no module under this fully_shard call{hint}; "
                "keys are exact module FQNs relative to the module passed to fully_shard"
            )
    return tuple(found.values())
