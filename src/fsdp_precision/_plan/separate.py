"""The separate-units layout: the public-API way to keep parameters in another dtype.

Every module holding mapped parameters becomes its own ``fully_shard`` unit (``param_dtype=None``
when they are stored in the dtype they are kept in, else that dtype, and no input cast: the
activation boundary does not move; the caller's other fields kept), then the planned units
follow with plain ``MixedPrecisionPolicy``, every unit after the units inside it. One layout
serves three uses: ``layout="separate_units"``, the ``"separate_units"`` estimate of
``PrecisionPlan.alternatives()``, and the reference builder :func:`wrap_separate_units`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._base.errors import ParamDtypeMapError
from fsdp_precision._plan.build import UnitSpec, build_units
from fsdp_precision._plan.casts import activation_dtype
from fsdp_precision._plan.claims import Claimed
from fsdp_precision._plan.data import PlanData
from fsdp_precision._plan.tops import topmost_owners
from fsdp_precision._plan.units import CONTAINERS
from fsdp_precision._plan.upcast import upcast_storage

__all__ = ["SeparateUnit", "separate_layout", "separate_units_plan", "wrap_separate_units"]

#: A plan's class (``PrecisionPlan``): the separate-units plan is one of the same class.
Plan = TypeVar("Plan", bound=PlanData)


@dataclass(frozen=True)
class SeparateUnit:
    """One ``fully_shard`` call of the separate-units layout.

    Attributes:
        modules: Root-relative module FQNs of the call (``""`` is the root).
        policy: Its plain ``MixedPrecisionPolicy``.
        kept: A module holding mapped parameters, made its own unit (not a planned unit).
    """

    modules: tuple[str, ...]
    policy: MixedPrecisionPolicy
    kept: bool


def _cannot(reason: str) -> ParamDtypeMapError:
    return ParamDtypeMapError(
        f"separate units cannot express this plan: {reason}. Use layout='in_unit' (one unit, "
        "exact map)"
    )


def _inside(names: Sequence[str], fqn: str) -> bool:
    return any(not n or fqn.startswith(n + ".") for n in names)


def separate_layout(plan: PlanData) -> tuple[SeparateUnit, ...]:
    """The ``fully_shard`` calls that express ``plan`` with separate units, in order.

    Raises :class:`ParamDtypeMapError` with the reason when they cannot: a module holding kept
    parameters also holds parameters computed in another dtype (the root included), a container
    that nobody calls would hold them, or a grouped call mixes kept and other modules.
    """
    model = plan.model
    by_name = {f: p for f, p in plan.params_by_fqn.items() if p.shape}  # not the replicated
    kept = {f: p.compute for f, p in by_name.items() if p.mapped}
    owners: dict[str, torch.dtype] = {}  # module FQN -> the dtype its parameters are kept in
    for fqn, dtype in kept.items():
        module = fqn.rpartition(".")[0]
        if module in owners:
            continue
        prefix = f"{module}." if module else ""
        others = [
            f[len(prefix) :] for f in by_name if _inside([module], f) and kept.get(f) != dtype
        ]
        if others:
            claim = f"({by_name[fqn].rule} -> {dtype_name(dtype)})"
            listed = f"{others[:5]}{' ...' if len(others) > 5 else ''}"
            raise _cannot(
                f"kept parameter {fqn!r} {claim} sits directly on the root, which also holds "
                f"{listed} in other dtypes and has no child unit to give it"
                if not module
                else f"module {module!r} owns kept {fqn!r} {claim} and {listed} in other dtypes; "
                "a unit has one param_dtype, so keep the whole module"
            )
        if isinstance(model.get_submodule(module), CONTAINERS):
            raise _cannot(
                f"kept {fqn!r} sits in the container {module!r} "
                f"({type(model.get_submodule(module)).__name__}), which nobody calls, so its "
                "own unit would never be gathered"
            )
        owners[module] = dtype

    # A module with a boundary cast is one unit for its whole kept subtree, as in the in-unit
    # layout, whose hooks sit there: its own unit casts inputs and outputs the same way (the
    # input casts of kept modules inside it stay inside its unit).
    casts = {
        name: cast
        for name, cast in plan.module_casts.items()
        if not any(o != name and _inside([o], name) for o in plan.module_casts)
    }
    activation = activation_dtype(
        plan.rules.param_dtype,
        ((p.storage, p.numel) for p in plan.params_by_fqn.values() if not p.claimed),
    )
    for cast_module, cast in casts.items():
        for owner in [o for o in owners if _inside([cast_module], o) or o == cast_module]:
            del owners[owner]
        owners[cast_module] = cast.inputs

    def policy_of(
        names: Sequence[str], dtype: torch.dtype, base: MixedPrecisionPolicy | None
    ) -> MixedPrecisionPolicy:
        cast = casts.get(names[0]) if len(names) == 1 else None
        if cast is not None:  # FSDP's own input and output casts, as the boundary's
            return MixedPrecisionPolicy(
                param_dtype=dtype,
                reduce_dtype=plan.rules.reduce_dtype,
                output_dtype=activation if cast.outputs else None,
                cast_forward_inputs=True,
            )
        same = all(by_name[f].storage == dtype for f in kept if _inside(names, f))
        # A kept child keeps every field the caller set but param_dtype (verl's
        # replace(mp_policy, param_dtype=None)); with a param_dtype of its own (kept in another
        # dtype than stored) it casts no input: without a boundary cast, the module does.
        given: Any = plan.rules if base is None else base
        return MixedPrecisionPolicy(
            param_dtype=None if same else dtype,
            reduce_dtype=given.reduce_dtype,
            output_dtype=given.output_dtype,
            cast_forward_inputs=given.cast_forward_inputs and (same or base is not None),
        )

    module_names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    unit_names = [tuple(module_names[id(m)] for m in u.modules) for u in plan.units]
    members = {n for names in unit_names for n in names}
    # verl's topmost rule: one unit per kept subtree, at its top, where that forward runs.
    held = {f: kept.get(f) for f in by_name}
    owners = topmost_owners(model, owners, held, frozenset(casts) | members)
    extra = sorted((m for m in owners if m not in members), key=lambda n: -n.count("."))
    layout = [SeparateUnit((m,), policy_of([m], owners[m], None), kept=True) for m in extra]
    for unit, names in zip(plan.units, unit_names, strict=True):
        owned = [n for n in names if n in owners]
        dtypes = {owners[n] for n in owned}
        if owned and (len(owned) != len(names) or len(dtypes) > 1):
            raise _cannot(
                f"grouped unit [{unit.name}] mixes modules holding kept parameters ({owned}) "
                "with modules computing in another dtype; one fully_shard call has one "
                "param_dtype"
            )
        if owned:
            policy = policy_of(names, dtypes.pop(), unit.policy)
        else:
            policy = MixedPrecisionPolicy(  # inputs left uncast: apply() installs the cast
                param_dtype=unit.policy.param_dtype,
                reduce_dtype=unit.policy.reduce_dtype,
                output_dtype=unit.policy.output_dtype,
                cast_forward_inputs=unit.policy.cast_forward_inputs and not unit.uncast_inputs,
            )
        layout.append(SeparateUnit(names, policy, kept=False))
    return _children_first(layout)


def _children_first(layout: list[SeparateUnit]) -> tuple[SeparateUnit, ...]:
    """``layout`` with every unit after the units inside it, otherwise in its order: a kept
    module that contains a planned unit (``k`` owning a kept parameter beside the unit
    ``k.inner``) is wrapped after it, not before (``fully_shard`` cannot wrap inside a unit)."""
    pending = list(layout)
    ordered: list[SeparateUnit] = []
    while pending:
        for i, unit in enumerate(pending):
            if not any(
                other is not unit and _contains(unit.modules, other.modules) for other in pending
            ):
                ordered.append(pending.pop(i))
                break
    return tuple(ordered)


def _contains(outer: Sequence[str], inner: Sequence[str]) -> bool:
    """Whether a module of ``inner`` lies strictly under a module of ``outer``."""
    return any(_inside([o], i) and i != o for o in outer for i in inner)


def separate_units_plan(plan: Plan) -> Plan:
    """``plan`` expressed with separate units: the units of :func:`separate_layout`, built and
    checked to compute every parameter in its planned dtype."""
    model = plan.model
    layout = separate_layout(plan)
    specs = [
        UnitSpec(
            tuple(model.get_submodule(n) for n in unit.modules),
            policy=unit.policy,
            separate_unit=unit.kept,
        )
        for unit in layout
    ]
    claimed: Claimed = {
        id(model.get_parameter(p.fqn)): (p.compute, p.claimed_by)
        for u in plan.units
        for p in u.params
        if p.claimed_by is not None
    }
    upcasts = {
        id(model.get_parameter(p.fqn)): p.storage
        for u in plan.units
        for p in u.params
        if p.upcast_from is not None
    }
    units = build_units(model, plan.rules, specs, claimed, maps=False, upcasts=upcasts)
    planned = {p.fqn: p.compute for u in plan.units for p in u.params}
    for unit in units:
        for p in unit.params:
            if p.compute != planned[p.fqn]:
                raise _cannot(
                    f"{p.fqn!r} would compute in {dtype_name(p.compute)} in unit {unit.name}, "
                    f"planned {dtype_name(planned[p.fqn])}"
                )
    return replace(plan, units=units, layout="separate_units")


def wrap_separate_units(model: nn.Module, plan: PlanData, **fully_shard_kwargs: Any) -> nn.Module:
    """Wrap ``model`` the public-API way ``plan`` says, with separate units; return it.

    ``model`` has the planned model's structure (e.g. a ``copy.deepcopy`` of it made before
    wrapping). Every module holding kept parameters becomes its own ``fully_shard`` unit
    (``param_dtype=None`` where they are stored in their kept dtype, else that dtype; no input
    cast), then the planned units are wrapped with plain ``MixedPrecisionPolicy``. No patch is
    needed. The result trains bitwise like ``plan.apply()``, with more collectives.
    ``fully_shard_kwargs`` (mesh, offload_policy, ...) go to every call with the plan's
    ``reshard_after_forward``.

    Raises :class:`ParamDtypeMapError` with the reason when separate units cannot express the
    plan, and ``ValueError`` when ``model`` does not have the planned model's parameters.
    """
    separate = separate_units_plan(plan)
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters(remove_duplicate=False)]
    planned = [(n, tuple(p.shape)) for n, p in plan.model.named_parameters(remove_duplicate=False)]
    if shapes != planned:
        diff = sorted(set(shapes) ^ set(planned))[:3]
        raise ValueError(
            f"model does not have the planned model's parameters (differing: {diff}); pass a "
            "copy of plan.model made before wrapping (copy.deepcopy)"
        )
    kwargs = separate.knobs.checked_kwargs(fully_shard_kwargs)
    upcast_storage(model, separate.upcasts)
    names = {id(m): n for n, m in plan.model.named_modules(remove_duplicate=False)}
    for unit in separate.units:
        mods = [model.get_submodule(names[id(m)]) for m in unit.modules]
        fully_shard(mods[0] if len(mods) == 1 else mods, mp_policy=unit.policy, **kwargs)
    return model
