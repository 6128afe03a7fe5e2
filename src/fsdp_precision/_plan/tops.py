"""verl's topmost rule for the separate-units layout: one unit per kept subtree, where it runs.

Where a whole subtree is kept in one dtype (an ``mlp`` whose ``a`` and ``b`` are both kept), the
separate-units layout makes the subtree's topmost module one unit (verl wraps the topmost kept
module) instead of one unit per module that owns kept parameters: the same numerics, fewer
collectives. FSDP gathers a unit in its module's forward pre-hook, so the topmost module is a
unit only where its forward runs around every use of those parameters. Where a parent calls
``mlp.a`` and ``mlp.b`` itself and ``mlp``'s forward never runs, a unit on ``mlp`` would never
gather; its children stay units of their own. (A grouped ``fully_shard([mlp.a, mlp.b])`` is not
used instead: it reshards only after every member ran and waits for backward on the last one's
output, which holds only when each member runs once per forward, in order.)

Only a traced forward can tell: on the plan's ``example_inputs`` or the model's ``dummy_inputs``
(Hugging Face models), through :func:`~fsdp_precision._advise.usage.param_usage`, traced once
per model, the first time a kept subtree could be lifted, while the model is not yet sharded.
Without one (no inputs, a model already wrapped) no module is lifted: each module that owns
kept parameters is its own unit (correct, more collectives).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_precision._advise.usage import ParamUsage, param_usage
from fsdp_precision._plan.units import CONTAINERS

__all__ = ["forward_runs", "remember_inputs", "topmost_owners"]

#: One trace per model (the separate layout is read before and after the model is wrapped).
_traced: weakref.WeakKeyDictionary[nn.Module, ParamUsage | None] = weakref.WeakKeyDictionary()
#: The inputs a plan was compiled with, for that trace (``None``: the model's ``dummy_inputs``).
_inputs: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def remember_inputs(model: nn.Module, example_inputs: Any) -> None:
    """Trace ``model`` on ``example_inputs`` (one batch: a mapping, a tuple or a tensor) if
    its separate layout ever needs to know which forwards run; nothing is traced now."""
    if example_inputs is not None:
        _inputs[model] = example_inputs
        _traced.pop(model, None)


def _ancestors(fqn: str) -> list[str]:
    """``"a.b.c"`` -> ``["a", "a.b"]``: the proper ancestors below the root, outermost first."""
    parts = fqn.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _under(module: str, fqn: str) -> bool:
    return fqn.startswith(module + ".")


def _usage(model: nn.Module) -> ParamUsage | None:
    if model not in _traced:
        sharded = any(isinstance(p, DTensor) for p in model.parameters())
        _traced[model] = None if sharded else param_usage(model, _inputs.get(model))
    return _traced[model]


def topmost_owners(
    model: nn.Module,
    owners: Mapping[str, torch.dtype],
    params: Mapping[str, torch.dtype | None],
    fixed: frozenset[str],
) -> dict[str, torch.dtype]:
    """``owners`` (module FQN -> the dtype its parameters are kept in) with each lifted to its
    topmost ancestor whose whole subtree is kept in that dtype, which a traced forward saw
    running around every use of those parameters.

    ``params``: every sharded parameter FQN -> the dtype it is kept in (``None``: not kept).
    ``fixed``: modules that stay where they are (boundary casts, planned units' members): nothing
    is lifted to them or to a module holding one.
    """
    candidates: dict[str, str] = {}  # owner -> its topmost fully kept ancestor
    for owner, dtype in owners.items():
        if owner in fixed:
            continue
        for ancestor in _ancestors(owner):
            inside = [f for f in params if _under(ancestor, f)]
            module = model.get_submodule(ancestor)
            if (
                not isinstance(module, CONTAINERS)
                and all(params[f] == dtype for f in inside)
                and not any(f == ancestor or _under(ancestor, f) for f in fixed)
            ):
                candidates[owner] = ancestor
                break
    if not candidates:
        return dict(owners)
    usage = _usage(model)
    lifted: dict[str, torch.dtype] = {}
    for owner, dtype in owners.items():
        top = candidates.get(owner)
        if top is not None and usage is not None and _runs_around(usage, top, params):
            lifted[top] = dtype
        else:
            lifted[owner] = dtype
    return {m: d for m, d in lifted.items() if not any(_under(o, m) for o in lifted)}


def forward_runs(model: nn.Module, module: str) -> bool:
    """Whether ``module``'s forward runs around every use of its parameters, as far as the
    trace tells: ``True`` where no trace saw them used (nothing says otherwise)."""
    usage = _usage(model)
    if usage is None:
        return True
    inside = [n for n, p in model.named_parameters() if _under(module, n) and p.dim() > 0]
    return usage.outside(module, inside) is None


def _runs_around(usage: ParamUsage, module: str, params: Mapping[str, torch.dtype | None]) -> bool:
    """Whether the trace saw ``module``'s forward running around every use of its parameters
    (and saw them used at all: a forward that never reached it proves nothing)."""
    inside = [f for f in params if _under(module, f)]
    seen = any(usage.uses.get(f) for f in inside)
    return seen and usage.outside(module, inside) is None
