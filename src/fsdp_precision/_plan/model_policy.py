"""``model_policy``: one policy object for every ``fully_shard`` call a framework makes on a model.

The rules are compiled once, as for a single root unit, into root-relative entries by slot (see
:mod:`fsdp_precision._policy.scope`, where each call resolves them).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from fsdp_precision._patch import apply_param_dtype_map_patch
from fsdp_precision._plan.claims import fqns_by_param
from fsdp_precision._plan.compile import UnknownTorch, compile_param_dtype_maps
from fsdp_precision._plan.plan import PrecisionPlan
from fsdp_precision._plan.records import kept_reasons
from fsdp_precision._plan.upcast import upcast_storage
from fsdp_precision._policy.policy import ParamDtypeMixedPrecisionPolicy
from fsdp_precision._policy.scope import ModelScope, ModelScopedPolicy, Slot
from fsdp_precision._policy.unapplied import guard_unapplied
from fsdp_precision._rules.rules import PrecisionRules

__all__ = ["model_policy"]


def model_policy(
    model: nn.Module, rules: PrecisionRules, *, unknown_torch: UnknownTorch = "refuse"
) -> ParamDtypeMixedPrecisionPolicy:
    """One policy for every ``fully_shard`` call on ``model`` or any of its submodules.

    The rules and the model's keep declarations are compiled once (as for a single root unit:
    rules that match nothing, shadowed rules and degraded kept parameters are errors here,
    before anything is wrapped) into root-relative exact entries. A training forward of
    ``model`` that no ``fully_shard`` call prepared (a framework that skips FSDP on one process
    without a launcher) raises :class:`PolicyNotAppliedError` instead of running with the kept
    dtypes dropped. Pass the result as
    ``mp_policy`` to every call, in any order and grouping; each call takes the entries of the
    parameters it manages. Applies the patch. Once the call that includes ``model`` runs, an
    entry no call resolved (its parameter ignored, or its module wrapped with another policy)
    is a :class:`ParamDtypeMapError` naming it.

    Kept modules get their boundary casts (``Glob(..., boundary=...)``) from the first call
    that includes them. Parameters a user rule keeps wider than they are stored (a bf16
    checkpoint's router kept in fp32) are upcast exactly, in place, once every check passed
    (``PrecisionPlan.upcasts``).

    ``unknown_torch="public_api"``: on a torch the patch cannot run on, wrap each kept module
    as its own ``fully_shard`` unit now (on the default mesh over all ranks: the process group
    must exist), with a warning saying why and what it costs, and return a policy without a map
    for the framework's calls: the same numerics, public API only. ``"refuse"`` (default)
    raises the patch's error, which names what differs and this option.

    Raises ``ValueError`` for the deprecated ``rules.strategy="split"``: separate units are a
    unit layout, which a policy cannot choose.
    """
    if not isinstance(rules, PrecisionRules):
        raise TypeError(f"rules must be a PrecisionRules, got {type(rules).__name__}")
    if rules.strategy == "split":
        raise ValueError(
            "model_policy cannot plan separate units (PrecisionRules(strategy='split'), "
            "deprecated): they are a unit layout; plan them with "
            "compile_param_dtype_maps(..., layout='separate_units')"
        )
    plan = compile_param_dtype_maps(model, rules, [model], unknown_torch=unknown_torch)
    if plan.fallback is not None:
        return _separate_now(plan, rules)
    mapped = plan.units[0].param_dtype_map  # one canonical (first) name per parameter
    entries: dict[Slot, tuple[str, torch.dtype]] = {}
    for names in fqns_by_param(model).values():
        dtype = mapped.get(names[0])
        if dtype is None:
            continue
        for fqn in names:  # every registration: FSDP records one of them
            prefix, _, name = fqn.rpartition(".")
            owner = model.get_submodule(prefix) if prefix else model
            entries[(id(owner), name)] = (names[0], dtype)
    casts = plan.module_casts
    apply_param_dtype_map_patch()
    upcast_storage(model, plan.upcasts)  # every check passed
    guard_unapplied(model, type(model).__name__, dict(sorted(mapped.items())))
    # Every parameter kept in one dtype: the plan's unit is one of that dtype (build.py)
    unit_policy = plan.units[0].policy
    return ModelScopedPolicy(
        param_dtype=unit_policy.param_dtype,
        reduce_dtype=rules.reduce_dtype,
        output_dtype=unit_policy.output_dtype,
        cast_forward_inputs=rules.cast_forward_inputs,
        param_dtype_map=mapped,
        module_casts=casts,
        uncast_inputs=frozenset(rules.uncast_inputs),
        scope=ModelScope(
            root=id(model),
            model=type(model).__name__,
            entries=entries,
            modules=weakref.WeakSet(model.modules()),
            casts={id(model.get_submodule(f)): (f, c) for f, c in casts.items()},
            reasons=kept_reasons(plan.units[0].params, mapped),
        ),
    )


def _separate_now(plan: PrecisionPlan, rules: PrecisionRules) -> ParamDtypeMixedPrecisionPolicy:
    """The public-API layout's kept units, wrapped now; a map-less policy for the rest."""
    if not dist.is_initialized():
        raise RuntimeError(
            "model_policy(..., unknown_torch='public_api') wraps the kept modules as their own "
            "fully_shard units when it is called, and no process group exists yet; call "
            "torch.distributed.init_process_group() (or create the framework's Accelerator or "
            "Trainer arguments) first"
        )
    upcast_storage(plan.model, plan.upcasts)
    for unit in plan.units:
        if unit.separate_unit:
            target = unit.modules[0] if len(unit.modules) == 1 else list(unit.modules)
            fully_shard(target, mp_policy=unit.policy)
    return ParamDtypeMixedPrecisionPolicy(
        param_dtype=rules.param_dtype,
        reduce_dtype=rules.reduce_dtype,
        output_dtype=rules.output_dtype,
        cast_forward_inputs=rules.cast_forward_inputs,
    )
