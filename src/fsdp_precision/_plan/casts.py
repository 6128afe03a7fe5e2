"""Which modules of a planned unit get boundary casts, from the rules that claimed their
parameters (``Glob(..., boundary=...)``; see :mod:`fsdp_precision._policy.casts`).

A module gets one where the whole subtree it holds is kept: every parameter under it that the
unit manages was claimed by a rule, and all compute in one dtype other than the activations'.
Only the outermost such module of a subtree casts its outputs back (a kept ``time_embedder``
hands its fp32 values from one linear to the next, not through bf16; a container such as a
``ModuleList`` of norms is never called, so its members do), and never a module whose subtree
holds parameters of another dtype (a block with a kept ``scale_shift_table``, RWKV's attention
with its ``time_decay``): its forward does more than use what is kept. The kept modules inside
it cast their inputs only: a no-op, unless the model's own code rounds in between
(LTX-Video's ``AdaLayerNormSingle`` casts the timestep features to the activations' dtype
before its kept embedder's first linear). A unit kept whole gets none: FSDP casts its inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
import torch.nn as nn

from fsdp_precision._base.errors import ParamDtypeMapError
from fsdp_precision._hf.boundaries import returns_activations
from fsdp_precision._plan.claims import Claimed
from fsdp_precision._plan.units import CONTAINERS
from fsdp_precision._policy.casts import Boundary, ModuleCast, cast_for
from fsdp_precision._rules.rules import DeclaredRule, rule_label

__all__ = ["activation_dtype", "local_casts", "module_casts"]


def activation_dtype(
    param_dtype: torch.dtype | None, unclaimed: Iterable[tuple[torch.dtype, int]]
) -> torch.dtype | None:
    """The dtype activations flow in between kept modules: ``param_dtype``, else the storage
    dtype of most ``(dtype, numel)`` unclaimed floating parameters (``None`` if there are none)."""
    if param_dtype is not None:
        return param_dtype
    counts: dict[torch.dtype, int] = {}
    for dtype, numel in unclaimed:
        if dtype.is_floating_point:
            counts[dtype] = counts.get(dtype, 0) + numel
    return max(counts, key=counts.__getitem__) if counts else None


def module_casts(
    members: Sequence[nn.Module],
    compute: Mapping[int, torch.dtype],
    claimed: Claimed,
    activation: torch.dtype | None,
    names: Mapping[int, str],
    runs: Callable[[str], bool] = lambda name: True,
) -> dict[str, ModuleCast]:
    """Root-relative module FQN (``names``: ``id(module) -> FQN``) -> cast, for one call of
    ``members`` computing the parameters it manages (by ``id``) as ``compute`` says, with
    activations in ``activation``. ``runs(FQN)``: whether a module with children holding the
    kept parameters runs its own forward around their uses (a parent may call the children
    itself); where it does not, its children get the casts. Raises
    :class:`ParamDtypeMapError` where the user rules that claimed one module's parameters ask
    for different boundaries."""
    casts: dict[str, ModuleCast] = {}
    if activation is None:
        return casts
    for member in members:
        covered: list[str] = []  # outermost cast modules so far: their subtrees are done
        for name, module in member.named_modules():
            if isinstance(module, CONTAINERS):  # never called: its members get the casts
                continue
            if "" in covered:  # a unit kept whole: FSDP casts its inputs, nothing inside does
                continue
            if any(name.startswith(f"{c}.") for c in covered):
                inner = _inner_cast(module, compute, claimed, activation, names)
                if inner is not None:
                    casts.setdefault(names[id(module)], inner)
                continue
            params = [p for p in module.parameters() if p.dim() > 0]  # 0-dim: replicated
            if not params or not all(id(p) in compute and id(p) in claimed for p in params):
                continue
            dtypes = {compute[id(p)] for p in params}
            if len(dtypes) != 1 or activation in dtypes:
                continue
            nested = any(p.dim() > 0 for c in module.children() for p in c.parameters())
            if nested and not runs(names[id(module)]):
                continue  # a parent calls its children itself: they cast
            boundary = _boundary(names[id(module)], params, claimed)
            back = returns_activations(module)
            cast = cast_for(boundary, dtypes.pop(), params, activation, returns_activations=back)
            if cast is not None:
                casts.setdefault(names[id(module)], cast)
                covered.append(name)
    return casts


def _inner_cast(
    module: nn.Module,
    compute: Mapping[int, torch.dtype],
    claimed: Claimed,
    activation: torch.dtype,
    names: Mapping[int, str],
) -> ModuleCast | None:
    """An input cast for a module inside a cast subtree that holds kept parameters itself."""
    params = [p for p in module.parameters(recurse=False) if p.dim() > 0]
    if not params or not all(id(p) in compute and id(p) in claimed for p in params):
        return None
    dtypes = {compute[id(p)] for p in params}
    if len(dtypes) != 1 or activation in dtypes:
        return None
    if _boundary(names[id(module)], params, claimed) == "none":
        return None
    return ModuleCast(dtypes.pop())


def local_casts(
    member: nn.Module, prefix: str, casts: Mapping[str, ModuleCast]
) -> dict[str, ModuleCast]:
    """``casts`` (root-relative) as keys relative to ``member``, which is named ``prefix``."""
    if not prefix:
        return dict(casts)
    start = f"{prefix}."
    return {
        ("" if fqn == prefix else fqn[len(start) :]): cast
        for fqn, cast in casts.items()
        if fqn == prefix or fqn.startswith(start)
    }


def _boundary(name: str, params: Sequence[nn.Parameter], claimed: Claimed) -> Boundary:
    """The one boundary the user rules that claimed ``params`` ask for; ``"none"`` where only
    declarations and packed storage did (the model casts there for itself)."""
    asked: dict[Boundary, str] = {}
    for param in params:
        rule = claimed[id(param)][1]
        if not isinstance(rule, DeclaredRule):
            asked.setdefault(rule.boundary, rule_label(rule))
    if len(asked) > 1:
        shown = ", ".join(
            label + (" (boundary 'auto')" if b == "auto" else "") for b, label in asked.items()
        )
        raise ParamDtypeMapError(
            f"module {name or '<root>'!r} is kept whole, but the rules that claimed its "
            f"parameters ask for different boundaries: {shown}; give them the same boundary"
        )
    return next(iter(asked), "none")
