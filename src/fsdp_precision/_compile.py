"""Compile precision rules into one exact map per planned ``fully_shard`` call: the plan.

The plan is computed from the model alone (meta-device models work: only shapes, dtypes and
structure are read) and validated before anything is wrapped. Every record is built once,
complete (:mod:`fsdp_precision._records`); ``PrecisionPlan.apply`` then makes the calls in order.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_precision import _hf
from fsdp_precision._claims import Targets, check_not_degraded, claim_params
from fsdp_precision._dtypes import dtype_name
from fsdp_precision._errors import ParamDtypeMapError
from fsdp_precision._patch import release_traits
from fsdp_precision._policy import ParamDtypeMixedPrecisionPolicy
from fsdp_precision._records import PlannedParam, PlannedUnit, PrecisionPlan
from fsdp_precision._replicated import replicated_params
from fsdp_precision._rules import PrecisionRules, rule_label
from fsdp_precision._units import block_class_names, resolve_block_classes

__all__ = ["UnitSpec", "build_units", "compile_param_dtype_maps", "default_units"]

#: What ``units`` holds: a module, or a list of modules for a grouped call.
Unit = nn.Module | Sequence[nn.Module]


@dataclass(frozen=True)
class UnitSpec:
    """One ``fully_shard`` call to build: its modules and, for separate units, its policy.

    ``policy=None`` derives the policy from the rules (an exact map when ``maps``).
    """

    modules: tuple[nn.Module, ...]
    policy: MixedPrecisionPolicy | None = None
    split_child: bool = False


def default_units(model: nn.Module) -> list[nn.Module]:
    """Every module whose class a ``_no_split_modules`` of the model declares, then the root; the
    root alone for a model that declares none. Declared names that resolve to no class are
    named in a warning; none resolving is a ``ValueError`` (see ``resolve_block_classes``)."""
    if not block_class_names(model):
        return [model]
    names = resolve_block_classes(model)
    blocks = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    return [*blocks, model]


def fqns_by_param(model: nn.Module) -> dict[int, list[str]]:
    """Every parameter (by ``id``) and all its names, in ``named_parameters`` order."""
    fqns_of: dict[int, list[str]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        fqns_of.setdefault(id(param), []).append(fqn)
    return fqns_of


def compile_param_dtype_maps(
    model: nn.Module,
    rules: PrecisionRules,
    units: Sequence[Unit] | None = None,
    *,
    world_size: int = 1,
    reshard_after_forward: bool | int | None = None,
    hsdp: bool = False,
) -> PrecisionPlan:
    """Compile ``rules`` into one exact map per planned ``fully_shard`` call.

    ``units`` are the modules (or lists of modules, for a grouped call) that will be passed to
    ``fully_shard``, in the order the calls will be made: innermost first, the root last. Default:
    :func:`default_units`. Each parameter is claimed by the first unit that manages it.
    ``world_size`` (shards per unit), ``reshard_after_forward`` (as passed to ``fully_shard``)
    and ``hsdp`` (a 2-D replicate x shard mesh) shape the collective counts and bytes the plan
    reports; :meth:`PrecisionPlan.apply` passes the plan's ``reshard_after_forward``.

    Raises :class:`ParamDtypeMapError` (before anything is wrapped) for rules that match nothing,
    user rules that earlier rules fully shadow, parameters no unit owns, ties across units,
    degraded kept parameters, grouped calls that cannot express the per-member dtypes, and
    layouts that separate units (``strategy="split"``) cannot express.
    """
    if not isinstance(rules, PrecisionRules):
        raise TypeError(f"rules must be a PrecisionRules, got {type(rules).__name__}")
    _check_knobs(world_size, reshard_after_forward, hsdp)
    specs = list(default_units(model) if units is None else units)
    if not specs:
        raise ValueError("units is empty; pass the modules to wrap, the root last")

    fqns_of = fqns_by_param(model)
    decision_dtype = rules.param_dtype or _majority_dtype(model)
    decls = tuple(_hf.declarations(model, decision_dtype) if rules.hf_keep_in_fp32 else ())
    targets, claims = claim_params(model, rules, decls, fqns_of)
    params = {id(p): p for p in model.parameters()}
    for pid, (kept, rule) in targets.items():
        check_not_degraded(fqns_of[pid][0], rule, kept, params[pid].dtype)

    module_names = {id(m) for _, m in model.named_modules(remove_duplicate=False)}
    spec_modules = [
        (tuple(s) if isinstance(s, Sequence) and not isinstance(s, nn.Module) else (s,))
        for s in specs
    ]
    for mods in spec_modules:
        for m in mods:
            if id(m) not in module_names:
                raise ParamDtypeMapError(
                    f"unit module {type(m).__name__} is not a submodule of the model"
                )
    split = rules.strategy == "split"
    planned = build_units(
        model, rules, [UnitSpec(mods) for mods in spec_modules], targets, maps=not split
    )
    plan = PrecisionPlan(
        replicated=_replicated(model, targets, fqns_of),
        model=model,
        rules=rules,
        units=planned,
        declarations=decls,
        claims=claims,
        world_size=world_size,
        reshard_after_forward=reshard_after_forward,
        hsdp=hsdp,
    )
    if not split:
        return plan
    from fsdp_precision._separate import separate_units_plan

    return separate_units_plan(plan)


def _replicated(
    model: nn.Module, targets: Targets, fqns_of: dict[int, list[str]]
) -> tuple[PlannedParam, ...]:
    """The 0-dim parameters: in no unit, replicated, computing in their storage dtype."""
    planned = []
    for fqn, param in replicated_params(model):
        kept, rule = targets.get(id(param), (None, None))
        if kept is not None and kept != param.dtype:
            raise ParamDtypeMapError(
                f"0-dim parameter {fqn!r} is replicated, not sharded (torch's fully_shard "
                f"cannot shard scalars), so it computes in its storage dtype "
                f"{dtype_name(param.dtype)}, but {rule_label(rule)} asks for {dtype_name(kept)}: "
                "store it in that dtype (e.g. param.data = "
                f"param.data.to(torch.{dtype_name(kept)})) or drop the rule"
            )
        planned.append(
            PlannedParam(
                fqn=fqn,
                key=fqn,
                shape=(),
                storage=param.dtype,
                compute=param.dtype,
                reduce=param.dtype if param.requires_grad else None,
                claimed_by=rule,
                aliases=tuple(fqns_of[id(param)][1:]),
            )
        )
    return tuple(planned)


def _check_knobs(world_size: object, reshard_after_forward: object, hsdp: object) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not isinstance(hsdp, bool):
        raise ValueError(f"hsdp must be True or False, got {hsdp!r}")
    rsf = reshard_after_forward
    if rsf is None or isinstance(rsf, bool):
        return
    if not isinstance(rsf, int) or rsf < 1 or world_size % rsf:
        raise ValueError(
            f"reshard_after_forward must be None, True, False or an integer that divides "
            f"world_size={world_size} (the group size to reshard to after forward, as "
            f"fully_shard takes it), got {rsf!r}"
        )


def build_units(
    model: nn.Module,
    rules: PrecisionRules,
    specs: Sequence[UnitSpec],
    targets: Targets,
    *,
    maps: bool,
) -> tuple[PlannedUnit, ...]:
    """The planned units of ``specs``, in order; each parameter goes to the first that has it.

    A spec without a policy computes kept parameters in their targets and the rest in
    ``rules.param_dtype``, with an exact map when ``maps``; a spec with a policy (a separate
    unit) computes in its ``param_dtype`` (its storage dtype for ``None``).
    """
    module_names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    fqns_of = fqns_by_param(model)
    promotes_reduce = release_traits().mixed_dtype_reduce  # 2.15: see _promoted_reduce
    unit_of: dict[int, int] = {}
    planned: list[PlannedUnit] = []
    for index, spec in enumerate(specs):
        mods = spec.modules
        name = ", ".join(module_names[id(m)] or "<root>" for m in mods)
        # (local name, parameter) of every registration this call manages, aliases included
        rows: list[tuple[str, nn.Parameter]] = []
        for m in mods:
            for local, param in m.named_parameters(remove_duplicate=False):
                if param.dim() == 0:  # replicated, in no unit (see _replicated)
                    continue
                if unit_of.setdefault(id(param), index) == index:
                    rows.append((local, param))
        entries = _entries(rows, targets, rules, spec)
        _check_grouped_keys(name, rows, entries, targets, rules, spec, grouped=len(mods) > 1)
        reduce_dtype = rules.reduce_dtype if spec.policy is None else spec.policy.reduce_dtype
        params: list[PlannedParam] = []
        mapped: dict[str, torch.dtype] = {}  # the call's map: one canonical key per parameter
        for local, param in rows:
            pid = id(param)
            if any(p.fqn == fqns_of[pid][0] for p in params):
                continue  # an alias inside the same unit
            compute = entries.get(pid) or _unmapped(param, rules, spec)
            if pid in entries:
                mapped[local] = entries[pid]
            params.append(
                PlannedParam(
                    fqn=fqns_of[pid][0],
                    key=local,
                    shape=tuple(param.shape),
                    storage=param.dtype,
                    compute=compute,
                    reduce=(reduce_dtype or compute) if param.requires_grad else None,
                    claimed_by=targets.get(pid, (None, None))[1],
                    aliases=tuple(fqns_of[pid][1:]),
                    mapped=pid in entries,
                )
            )
        if reduce_dtype is None and promotes_reduce:
            params = _promoted_reduce(params)
        policy = spec.policy or _policy_for(name, params, mapped, rules, maps=maps)
        planned.append(
            PlannedUnit(
                name=name,
                modules=mods,
                params=tuple(params),
                policy=policy,
                is_root=any(m is model for m in mods),
                split_child=spec.split_child,
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


def _unmapped(param: nn.Parameter, rules: PrecisionRules, spec: UnitSpec) -> torch.dtype:
    """The dtype a call computes ``param`` in without a map entry: the policy's ``param_dtype``
    for a floating parameter (its storage dtype for ``None``), else its storage dtype."""
    default = rules.param_dtype if spec.policy is None else spec.policy.param_dtype
    return (default if param.dtype.is_floating_point else None) or param.dtype


def _entries(
    rows: Sequence[tuple[str, nn.Parameter]],
    targets: Targets,
    rules: PrecisionRules,
    spec: UnitSpec,
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
    trainable = {p.dtype for _, p in rows if p.requires_grad and p.dtype.is_floating_point}
    mixed = len(trainable) > 1
    entries: dict[int, torch.dtype] = {}
    for _, param in rows:
        dtype = targets.get(id(param), (None, None))[0]
        if dtype is not None and (mixed or dtype != _unmapped(param, rules, spec)):
            entries[id(param)] = dtype
    return entries


def _check_grouped_keys(
    name: str,
    rows: Sequence[tuple[str, nn.Parameter]],
    entries: dict[int, torch.dtype],
    targets: Targets,
    rules: PrecisionRules,
    spec: UnitSpec,
    *,
    grouped: bool,
) -> None:
    """A grouped ``fully_shard`` broadcasts each key to every member that has the name: a key
    may not reach a parameter that computes in another dtype."""
    if not grouped:
        return
    by_key: dict[str, list[nn.Parameter]] = {}
    for local, param in rows:
        by_key.setdefault(local, []).append(param)
    for local, same in by_key.items():
        if not any(id(p) in entries for p in same):
            continue
        computes = [(entries.get(id(p)) or _unmapped(p, rules, spec), p) for p in same]
        if len({dtype for dtype, _ in computes}) > 1:
            (d1, p1), (d2, p2) = computes[0], next(c for c in computes if c[0] != computes[0][0])
            raise ParamDtypeMapError(
                f"grouped unit [{name}] cannot give key {local!r} two dtypes "
                f"({dtype_name(d1)} by {_label(targets, p1)}, {dtype_name(d2)} by "
                f"{_label(targets, p2)}): a grouped fully_shard broadcasts each key to every "
                "member. Wrap the members separately, or make the rules agree"
            )


def _label(targets: Targets, param: nn.Parameter) -> str:
    return rule_label(targets.get(id(param), (None, None))[1])


def _promoted_reduce(params: list[PlannedParam]) -> list[PlannedParam]:
    """torch 2.15's reduce dtype of a unit without ``reduce_dtype``: the promotion of its
    trainable parameters' gradient dtypes, their storage dtypes (``_get_reduce_dtype``), e.g.
    fp32 for fp32-stored parameters computing in bf16; before 2.15 it was the compute dtype."""
    storages = {p.storage for p in params if p.reduce is not None}
    if not storages:
        return params
    try:
        dtype = functools.reduce(torch.promote_types, storages)
    except RuntimeError:  # float8 does not promote (torch's own reduce would fail too)
        return params
    return [replace(p, reduce=dtype) if p.reduce is not None else p for p in params]


def _majority_dtype(model: nn.Module) -> torch.dtype:
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.__getitem__) if counts else torch.float32


def _policy_for(
    name: str,
    params: Sequence[PlannedParam],
    mapped: dict[str, torch.dtype],
    rules: PrecisionRules,
    *,
    maps: bool,
) -> MixedPrecisionPolicy:
    # A unit whose every parameter computes in a mapped dtype (e.g. a norm or an embedder that
    # the size rule made its own unit) must not cast its inputs to param_dtype: that would move
    # the activation boundary and lose exactly the precision the rules keep.
    all_mapped = bool(params) and len(mapped) == len(params)
    cast = rules.cast_forward_inputs and not all_mapped
    if not maps or not mapped:
        return MixedPrecisionPolicy(
            param_dtype=rules.param_dtype,
            reduce_dtype=rules.reduce_dtype,
            output_dtype=rules.output_dtype,
            cast_forward_inputs=cast,
        )
    trainable_dtypes = {p.compute for p in params if p.reduce is not None}
    if len(trainable_dtypes) > 1 and rules.reduce_dtype is None:
        raise ParamDtypeMapError(
            f"unit {name} computes trainable parameters in "
            f"{sorted(dtype_name(d) for d in trainable_dtypes)} but reduce_dtype is None; set "
            "PrecisionRules(reduce_dtype=torch.float32)"
        )
    return ParamDtypeMixedPrecisionPolicy(
        param_dtype=rules.param_dtype,
        reduce_dtype=rules.reduce_dtype,
        output_dtype=rules.output_dtype,
        cast_forward_inputs=cast,
        param_dtype_map=mapped,
    )


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
