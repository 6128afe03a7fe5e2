"""Build the planned units: which call manages each parameter, in which dtype, with which map.

Shared by the in-unit layout (:func:`fsdp_precision.compile_param_dtype_maps`) and the
separate-units layout (:mod:`fsdp_precision._plan.separate`), so that both compute every
parameter from the same rules.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._base.errors import ParamDtypeMapError
from fsdp_precision._plan.casts import activation_dtype, local_casts, module_casts
from fsdp_precision._plan.claims import Claimed, fqns_by_param
from fsdp_precision._plan.quantized import gather_format
from fsdp_precision._plan.records import PlannedParam, PlannedUnit
from fsdp_precision._plan.tops import forward_runs
from fsdp_precision._policy.armed import planning
from fsdp_precision._policy.casts import ModuleCast
from fsdp_precision._policy.inputs import accepted
from fsdp_precision._policy.policy import ParamDtypeMixedPrecisionPolicy
from fsdp_precision._policy.scope import ModelScope, ModelScopedPolicy, Slot
from fsdp_precision._releases import release_traits
from fsdp_precision._rules.rules import PrecisionRules, rule_label

__all__ = ["UnitSpec", "build_units"]


@dataclass(frozen=True)
class UnitSpec:
    """One ``fully_shard`` call to build: its modules and, in the separate-units layout, its
    policy.

    Attributes:
        modules: The module(s) passed to ``fully_shard``.
        policy: ``None`` derives the policy from the rules (an exact map where ``maps``); a
            policy fixes it (a unit of the separate-units layout). (Default: ``None``)
        separate_unit: A module holding mapped parameters made its own unit by the
            separate-units layout. (Default: ``False``)
    """

    modules: tuple[nn.Module, ...]
    policy: MixedPrecisionPolicy | None = None
    separate_unit: bool = False


def build_units(
    model: nn.Module,
    rules: PrecisionRules,
    specs: Sequence[UnitSpec],
    claimed: Claimed,
    *,
    maps: bool,
    upcasts: Mapping[int, torch.dtype] | None = None,
) -> tuple[PlannedUnit, ...]:
    """The planned units of ``specs``, in order; each parameter goes to the first that has it.

    A spec without a policy computes claimed parameters in their rules' dtypes and the rest in
    ``rules.param_dtype``, with an exact map when ``maps``; a spec with a policy computes in its
    ``param_dtype`` (its storage dtype for ``None``). Raises :class:`ParamDtypeMapError` for
    parameters no unit owns, ties across units and grouped calls that cannot express their
    members' dtypes. ``upcasts`` (``id(parameter) -> dtype``) plans parameters whose storage
    will be upcast before the first call in that storage dtype (``PlannedParam.upcast_from``).
    """
    storage = _Storage(upcasts or {})
    activation = activation_dtype(
        rules.param_dtype,
        ((storage(p), p.numel()) for p in model.parameters() if id(p) not in claimed),
    )
    module_names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    fqns_of = fqns_by_param(model)
    unit_of: dict[int, int] = {}
    planned: list[PlannedUnit] = []
    for index, spec in enumerate(specs):
        # (local name, parameter) of every registration this call manages, aliases included
        rows: list[tuple[str, nn.Parameter]] = []
        for m in spec.modules:
            for local, param in m.named_parameters(remove_duplicate=False):
                if param.dim() == 0:  # replicated, in no unit (see replicated.py)
                    continue
                if unit_of.setdefault(id(param), index) == index:
                    rows.append((local, param))
        name = ", ".join(module_names[id(m)] or "<root>" for m in spec.modules)
        planned.append(
            _unit(
                model,
                name,
                spec,
                rows,
                rules,
                claimed,
                fqns_of,
                storage,
                activation,
                module_names,
                maps=maps,
            )
        )
    scalars = {id(p) for p in model.parameters() if p.dim() == 0}
    unowned = [f[0] for pid, f in fqns_of.items() if pid not in unit_of and pid not in scalars]
    if unowned:
        raise ParamDtypeMapError(
            f"parameters {unowned[:5]} belong to no planned unit; FSDP would leave them "
            "unsharded. Put the root module last in units (it owns whatever is left)"
        )
    _check_ties(fqns_of, [[module_names[id(m)] for m in s.modules] for s in specs])
    return tuple(planned)


class _Storage:
    """The storage dtype each parameter will have at the first call (upcasts applied)."""

    def __init__(self, upcasts: Mapping[int, torch.dtype]) -> None:
        self.upcasts = upcasts

    def __call__(self, param: nn.Parameter) -> torch.dtype:
        return self.upcasts.get(id(param), param.dtype)


def _unit(
    model: nn.Module,
    name: str,
    spec: UnitSpec,
    rows: Sequence[tuple[str, nn.Parameter]],
    rules: PrecisionRules,
    claimed: Claimed,
    fqns_of: dict[int, list[str]],
    storage: _Storage,
    activation: torch.dtype | None,
    module_names: dict[int, str],
    *,
    maps: bool,
) -> PlannedUnit:
    entries = _entries(rows, claimed, rules, spec, storage)
    grouped = len(spec.modules) > 1
    split = grouped and _keys_split(rows, entries, rules, spec, storage)
    reduce_dtype = rules.reduce_dtype if spec.policy is None else spec.policy.reduce_dtype
    params: list[PlannedParam] = []
    mapped: dict[str, torch.dtype] = {}  # the call's map: one canonical key per parameter
    seen: set[int] = set()
    planned_ids: list[int] = []
    for local, param in rows:
        pid = id(param)
        if pid in seen:
            continue  # an alias inside the same unit
        seen.add(pid)
        planned_ids.append(pid)
        compute = entries.get(pid) or _unmapped(storage(param), rules, spec)
        if pid in entries:
            mapped[local] = entries[pid]
        params.append(
            PlannedParam(
                fqn=fqns_of[pid][0],
                key=local,
                shape=tuple(param.shape),
                storage=storage(param),
                compute=compute,
                reduce=(reduce_dtype or compute) if param.requires_grad else None,
                claimed_by=claimed.get(pid, (None, None))[1],
                aliases=tuple(fqns_of[pid][1:]),
                mapped=pid in entries,
                upcast_from=param.dtype if pid in storage.upcasts else None,
                gathered_as=gather_format(param),
            )
        )
    if reduce_dtype is None:  # the release decides (2.15 promotes over the storage dtypes)
        promoted = release_traits().default_reduce_dtype(p.storage for p in params if p.reduce)
        if promoted is not None:
            params = [replace(p, reduce=promoted) if p.reduce else p for p in params]
    casts: dict[str, ModuleCast] = {}
    if spec.policy is None:  # a separate-units layout's units cast by their own policies
        compute_of = {pid: p.compute for pid, p in zip(planned_ids, params, strict=True)}
        runs = functools.partial(forward_runs, model)  # where a parent calls its children
        casts = module_casts(spec.modules, compute_of, claimed, activation, module_names, runs)
    # A grouped call broadcasts each key to every member that has the name: where one key
    # names parameters of two dtypes, or a cast's name reaches other members, the call's
    # policy resolves by slot (as model_policy's does) instead of by key.
    scope = None
    if split or (grouped and casts):
        scope = _by_slot(model, spec, entries, fqns_of, casts, module_names)
    first = spec.modules[0]
    keys = {} if grouped else local_casts(first, module_names[id(first)], casts)
    own = keys.get("") if spec.policy is None else None
    uncast: frozenset[str] = frozenset()
    if own is not None and all(p.compute == own.inputs for p in params):
        # The unit's module is kept whole: it computes as a unit of that dtype, FSDP casting its
        # inputs (and its outputs back), as the separate-units layout makes it.
        casts.pop(module_names[id(first)])
        params = [replace(p, mapped=False) for p in params]
        policy: MixedPrecisionPolicy = MixedPrecisionPolicy(
            param_dtype=own.inputs,
            reduce_dtype=rules.reduce_dtype,
            output_dtype=activation if own.outputs else rules.output_dtype,
            cast_forward_inputs=True,
        )
    else:
        uncast = frozenset() if spec.separate_unit else _uncast(spec.modules, rules, params, mapped)
        policy = spec.policy or _policy_for(
            name, params, mapped, keys, rules, maps=maps, scope=scope, uncast=uncast
        )
    return PlannedUnit(
        name=name,
        modules=spec.modules,
        params=tuple(params),
        policy=policy,
        is_root=any(m is model for m in spec.modules),
        separate_unit=spec.separate_unit,
        module_casts=casts,
        uncast_inputs=uncast,
    )


def _unmapped(stored: torch.dtype, rules: PrecisionRules, spec: UnitSpec) -> torch.dtype:
    """The dtype a call computes a parameter ``stored`` so in without a map entry: the
    policy's ``param_dtype`` for a floating one (its storage dtype for ``None``), else its
    storage dtype."""
    default = rules.param_dtype if spec.policy is None else spec.policy.param_dtype
    return (default if stored.is_floating_point else None) or stored


def _entries(
    rows: Sequence[tuple[str, nn.Parameter]],
    claimed: Claimed,
    rules: PrecisionRules,
    spec: UnitSpec,
    storage: _Storage,
) -> dict[int, torch.dtype]:
    """``id(parameter) -> dtype`` of the call's map entries (none for a separate unit's spec).

    A rule asking for the dtype the call computes its parameter in anyway needs no entry, and a
    map left empty takes torch's exact path (``explain()`` still shows the rule). Except in a call
    whose trainable parameters mix storage dtypes: torch's path refuses such a unit ("FSDP
    expects uniform original parameter dtype"), so every claimed parameter keeps its entry and
    the unit is a mapped one.
    """
    if spec.policy is not None:
        return {}
    trainable = {storage(p) for _, p in rows if p.requires_grad and storage(p).is_floating_point}
    mixed = len(trainable) > 1
    entries: dict[int, torch.dtype] = {}
    for _, param in rows:
        dtype = claimed.get(id(param), (None, None))[0]
        if dtype is not None and (mixed or dtype != _unmapped(storage(param), rules, spec)):
            entries[id(param)] = dtype
    return entries


def _keys_split(
    rows: Sequence[tuple[str, nn.Parameter]],
    entries: dict[int, torch.dtype],
    rules: PrecisionRules,
    spec: UnitSpec,
    storage: _Storage,
) -> bool:
    """Whether one key of a grouped call names parameters computing in different dtypes."""
    by_key: dict[str, list[nn.Parameter]] = {}
    for local, param in rows:
        by_key.setdefault(local, []).append(param)
    for same in by_key.values():
        if any(id(p) in entries for p in same):
            computes = {entries.get(id(p)) or _unmapped(storage(p), rules, spec) for p in same}
            if len(computes) > 1:
                return True
    return False


def _by_slot(
    model: nn.Module,
    spec: UnitSpec,
    entries: dict[int, torch.dtype],
    fqns_of: dict[int, list[str]],
    casts: dict[str, ModuleCast],
    names: dict[int, str],
) -> ModelScope:
    """The scope of a grouped call resolved by slot: every registration of its mapped
    parameters, and its casts (root-relative) by module."""
    slots: dict[Slot, tuple[str, torch.dtype]] = {}
    by_module: dict[int, tuple[str, ModuleCast]] = {}
    for member in spec.modules:
        for sub in member.modules():
            for attr, param in sub._parameters.items():
                if param is not None and id(param) in entries:
                    slots[(id(sub), attr)] = (fqns_of[id(param)][0], entries[id(param)])
            fqn = names[id(sub)]
            if fqn in casts:
                by_module[id(sub)] = (fqn, casts[fqn])
    modules = weakref.WeakSet(m for member in spec.modules for m in member.modules())
    return ModelScope(
        root=id(model),
        model=type(model).__name__,
        entries=slots,
        modules=modules,
        casts=by_module,
    )


def _label(claimed: Claimed, param: nn.Parameter) -> str:
    return rule_label(claimed.get(id(param), (None, None))[1])


def _policy_for(
    name: str,
    params: Sequence[PlannedParam],
    mapped: dict[str, torch.dtype],
    casts: dict[str, ModuleCast],
    rules: PrecisionRules,
    *,
    maps: bool,
    scope: ModelScope | None = None,
    uncast: frozenset[str] = frozenset(),
) -> MixedPrecisionPolicy:
    # A unit whose every parameter computes in a mapped dtype (e.g. a norm or an embedder that
    # the size rule made its own unit) must not cast its inputs to param_dtype: that would move
    # the activation boundary and lose exactly the precision the rules keep.
    all_mapped = bool(params) and len(mapped) == len(params)
    cast = rules.cast_forward_inputs and not all_mapped
    if not maps or not (mapped or casts or uncast):
        return MixedPrecisionPolicy(  # with inputs left uncast, apply() installs the cast
            param_dtype=rules.param_dtype,
            reduce_dtype=rules.reduce_dtype,
            output_dtype=rules.output_dtype,
            cast_forward_inputs=cast and not uncast,
        )
    trainable_dtypes = {p.compute for p in params if p.reduce is not None}
    if len(trainable_dtypes) > 1 and rules.reduce_dtype is None:
        raise ParamDtypeMapError(
            f"unit {name} computes trainable parameters in "
            f"{sorted(dtype_name(d) for d in trainable_dtypes)} but reduce_dtype is None; set "
            "PrecisionRules(reduce_dtype=torch.float32)"
        )
    with planning():  # built where the patch cannot run too: the plan's apply() raises
        if scope is not None:  # keys for reading: the root-relative names
            return ModelScopedPolicy(
                param_dtype=rules.param_dtype,
                reduce_dtype=rules.reduce_dtype,
                output_dtype=rules.output_dtype,
                cast_forward_inputs=cast,
                param_dtype_map={fqn: dtype for fqn, dtype in scope.entries.values()},
                module_casts={fqn: c for fqn, c in scope.casts.values()},
                uncast_inputs=uncast,
                scope=scope,
            )
        return ParamDtypeMixedPrecisionPolicy(
            param_dtype=rules.param_dtype,
            reduce_dtype=rules.reduce_dtype,
            output_dtype=rules.output_dtype,
            cast_forward_inputs=cast,
            param_dtype_map=mapped,
            module_casts=casts,
            uncast_inputs=uncast,
        )


def _uncast(
    modules: Sequence[nn.Module],
    rules: PrecisionRules,
    params: Sequence[PlannedParam],
    mapped: dict[str, torch.dtype],
) -> frozenset[str]:
    """The ``rules.uncast_inputs`` a unit's input cast leaves out: those its modules' forwards
    take, where the unit casts inputs at all (a unit of kept parameters only casts none)."""
    all_mapped = bool(params) and len(mapped) == len(params)
    if not rules.cast_forward_inputs or rules.param_dtype is None or all_mapped:
        return frozenset()
    return frozenset().union(*(accepted(m, rules.uncast_inputs) for m in modules))


def _check_ties(fqns_of: dict[int, list[str]], unit_prefixes: list[list[str]]) -> None:
    """A tied parameter whose aliases live under different units cannot be sharded by torch."""

    def unit_index(fqn: str) -> int:
        for i, prefixes in enumerate(unit_prefixes):
            for prefix in prefixes:
                if prefix == "" or fqn.startswith(prefix + "."):
                    return i
        return len(unit_prefixes)

    for fqns in fqns_of.values():
        if len(fqns) < 2:
            continue
        owners = {unit_index(f) for f in fqns}
        if len(owners) > 1:
            raise ParamDtypeMapError(
                f"tied parameter {fqns[0]!r} (also {', '.join(fqns[1:])}) spans FSDP units "
                f"{sorted(owners)}; torch cannot shard a parameter shared across units. Put the "
                "modules that share it in one unit (e.g. leave the embedding and the head in "
                "the root)"
            )
