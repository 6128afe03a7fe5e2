"""Compile precision rules into one exact map per planned ``fully_shard`` call: the plan.

The plan is computed from the model alone (meta-device models work: only shapes, dtypes and
structure are read) and validated before anything is wrapped. ``PrecisionPlan.apply`` then makes
the ``fully_shard`` calls in order.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_precision import _hf
from fsdp_precision._dtypes import dtype_name
from fsdp_precision._errors import ParamDtypeMapError
from fsdp_precision._policy import ParamDtypeMixedPrecisionPolicy
from fsdp_precision._rules import DeclaredRule, PrecisionRules

__all__ = ["PlannedParam", "PlannedUnit", "PrecisionPlan", "compile_param_dtype_maps"]

UnitSpec = nn.Module | Sequence[nn.Module]


@dataclass(frozen=True)
class PlannedParam:
    """One parameter in the plan.

    Attributes:
        fqn: Root-relative FQN (the first alias).
        key: Its key in the unit's ``param_dtype_map`` (relative to the unit's module).
        shape: Parameter shape.
        storage: Storage dtype.
        compute: Compute (all-gather) dtype.
        reduce: Gradient reduce dtype (``None`` for frozen parameters).
        rule: What claimed it (``"default"`` when no rule did).
        aliases: Other FQNs of the same (tied) parameter.
    """

    fqn: str
    key: str
    shape: tuple[int, ...]
    storage: torch.dtype
    compute: torch.dtype
    reduce: torch.dtype | None
    rule: str
    aliases: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    def padded_numel(self, world_size: int) -> int:
        """Numel after FSDP's dim-0 padding for ``world_size`` shards."""
        if not self.shape:
            return world_size
        dim0 = -(-self.shape[0] // world_size) * world_size
        return int(dim0 * torch.Size(self.shape[1:]).numel())


@dataclass
class PlannedUnit:
    """One planned ``fully_shard`` call."""

    name: str
    modules: tuple[nn.Module, ...]
    params: list[PlannedParam] = field(default_factory=list)
    policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    is_root: bool = False
    split_child: bool = False  # a kept module made its own unit by the "split" strategy

    @property
    def param_dtype_map(self) -> dict[str, torch.dtype]:
        policy = self.policy
        if isinstance(policy, ParamDtypeMixedPrecisionPolicy):
            return dict(policy.param_dtype_map)
        return {}

    def gather_bytes(self, world_size: int = 1) -> dict[str, int]:
        """Bytes of one all-gather of this unit, by compute dtype (with dim-0 padding)."""
        out: dict[str, int] = {}
        for p in self.params:
            key = dtype_name(p.compute)
            out[key] = out.get(key, 0) + p.padded_numel(world_size) * p.compute.itemsize
        return out

    @property
    def trainable(self) -> bool:
        return any(p.reduce is not None for p in self.params)

    def collectives_per_step(self) -> tuple[int, int]:
        """(all-gathers, reduce-scatters) of one forward+backward with FSDP's defaults."""
        if not self.params:
            return (0, 0)
        gathers = 1 if self.is_root else 2  # non-root units reshard after forward
        return (gathers, 1 if self.trainable else 0)


@dataclass
class PrecisionPlan:
    """The compiled plan: units in ``fully_shard`` order (innermost first, root last)."""

    model: nn.Module
    rules: PrecisionRules
    units: list[PlannedUnit]
    declarations: list[_hf.Declaration]
    rule_claims: dict[str, list[str]]  # rule label -> claimed FQNs
    world_size: int = 1

    # ----------------------------------------------------------------- applying

    def apply(self, **fully_shard_kwargs: Any) -> nn.Module:
        """Make the planned ``fully_shard`` calls in order; return the model.

        Applies the patch first when a unit has a non-empty map. ``fully_shard_kwargs`` (mesh,
        reshard_after_forward, offload_policy, ...) go to every call.
        """
        from torch.distributed.fsdp import fully_shard

        if any(u.param_dtype_map for u in self.units):
            from fsdp_precision._patch import apply_param_dtype_map_patch

            apply_param_dtype_map_patch()
        for unit in self.units:
            target = unit.modules[0] if len(unit.modules) == 1 else list(unit.modules)
            fully_shard(target, mp_policy=unit.policy, **fully_shard_kwargs)
        return self.model

    # ----------------------------------------------------------------- reporting

    def totals(self) -> dict[str, Any]:
        """Units, collectives per step and bytes all-gathered per step, for this plan."""
        gathers = sum(u.collectives_per_step()[0] for u in self.units)
        scatters = sum(u.collectives_per_step()[1] for u in self.units)
        step_bytes = sum(
            sum(u.gather_bytes(self.world_size).values()) * u.collectives_per_step()[0]
            for u in self.units
        )
        return {
            "units": len([u for u in self.units if u.params]),
            "all_gathers_per_step": gathers,
            "reduce_scatters_per_step": scatters,
            "all_gather_bytes_per_step": step_bytes,
        }

    def alternatives(self) -> dict[str, dict[str, Any]]:
        """The same model under a uniform policy and under separate fp32 child units."""
        uniform_bytes = 0
        kept_modules: set[int] = set()
        extra_units = 0
        for unit in self.units:
            gathers = unit.collectives_per_step()[0]
            default = self.rules.param_dtype
            uniform_bytes += gathers * sum(
                p.padded_numel(self.world_size) * (default or p.storage).itemsize
                for p in unit.params
            )
            if unit.split_child:
                continue
            owners = {id(_owner(self.model, p.fqn)) for p in unit.params if p.rule != "default"}
            new = owners - kept_modules
            kept_modules |= owners
            extra_units += len(new)
        base = self.totals()
        split_units = [u for u in self.units if u.split_child]
        if split_units:  # this plan is already the split one
            extra_units = 0
        return {
            "uniform": {
                "units": base["units"],
                "all_gathers_per_step": base["all_gathers_per_step"],
                "reduce_scatters_per_step": base["reduce_scatters_per_step"],
                "all_gather_bytes_per_step": uniform_bytes,
                "note": "every parameter in param_dtype: kept parameters lose precision",
            },
            "separate_fp32_units": {
                "units": base["units"] + extra_units,
                "all_gathers_per_step": base["all_gathers_per_step"] + 2 * extra_units,
                "reduce_scatters_per_step": base["reduce_scatters_per_step"] + extra_units,
                "all_gather_bytes_per_step": base["all_gather_bytes_per_step"],
                "note": "each module owning a kept parameter as its own param_dtype=None unit",
            },
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form of the plan (``json.dumps(plan.to_dict())``)."""

        def dt(d: torch.dtype | None) -> str | None:
            return dtype_name(d) if d is not None else None

        return {
            "model": type(self.model).__name__,
            "rules": self.rules.describe(),
            "world_size": self.world_size,
            "units": [
                {
                    "name": u.name,
                    "modules": len(u.modules),
                    "split_child": u.split_child,
                    "policy": {
                        "param_dtype": dt(u.policy.param_dtype),
                        "reduce_dtype": dt(u.policy.reduce_dtype),
                        "param_dtype_map": {k: dt(v) for k, v in u.param_dtype_map.items()},
                    },
                    "all_gather_bytes_by_dtype": u.gather_bytes(self.world_size),
                    "collectives_per_step": dict(
                        zip(
                            ("all_gathers", "reduce_scatters"),
                            u.collectives_per_step(),
                            strict=True,
                        )
                    ),
                    "params": [
                        {
                            "fqn": p.fqn,
                            "key": p.key,
                            "shape": list(p.shape),
                            "storage": dt(p.storage),
                            "compute": dt(p.compute),
                            "reduce": dt(p.reduce),
                            "rule": p.rule,
                            "aliases": list(p.aliases),
                        }
                        for p in u.params
                    ],
                }
                for u in self.units
            ],
            "rule_claims": {k: len(v) for k, v in self.rule_claims.items()},
            "declarations": [
                {
                    "source": d.source,
                    "pattern": d.pattern,
                    "params": sorted(d.params),
                    "buffers": sorted(d.buffers),
                }
                for d in self.declarations
            ],
            "totals": self.totals(),
            "alternatives": self.alternatives(),
        }

    def to_json(self, **kwargs: Any) -> str:
        """``json.dumps(self.to_dict(), **kwargs)``."""
        return json.dumps(self.to_dict(), **kwargs)

    def explain(self, *, max_params: int = 12) -> str:
        """A human table: per unit, who claimed what, bytes per all-gather, collectives."""
        lines = [
            f"precision plan for {type(self.model).__name__} ({self.rules.describe()})",
            f"world size {self.world_size} (bytes include FSDP's dim-0 padding)",
            "",
        ]
        previous: tuple[Any, ...] | None = None
        repeats: list[str] = []

        def flush() -> None:
            if len(repeats) == 1:
                lines.append(f"unit {repeats[0]}: same as the unit above")
            elif repeats:
                lines.append(
                    f"units {repeats[0]} .. {repeats[-1]} ({len(repeats)} units): "
                    "same as the unit above"
                )
            repeats.clear()

        for unit in self.units:
            if not unit.params:
                continue
            signature = (
                tuple((p.key, p.storage, p.compute, p.rule.split(" ")[0]) for p in unit.params),
                unit.split_child,
                unit.is_root,
            )
            if signature == previous:
                repeats.append(unit.name)
                continue
            flush()
            previous = signature
            lines.extend(self._unit_lines(unit, max_params))
        flush()
        lines.append("")
        lines.append("rules (first match wins):")
        for label, fqns in self.rule_claims.items():
            sample = ", ".join(fqns[:3]) + (", ..." if len(fqns) > 3 else "")
            lines.append(f"    {label}: {len(fqns)} parameters{': ' + sample if fqns else ''}")
        for d in self.declarations:
            if not d.params:
                what = (
                    f"buffers only: {', '.join(sorted(d.buffers)[:3])}" if d.buffers else "nothing"
                )
                lines.append(f"    {d.source} {d.pattern!r}: matches {what}")
        totals, alt = self.totals(), self.alternatives()
        lines += [
            "",
            f"per step: {totals['all_gathers_per_step']} all-gathers, "
            f"{totals['reduce_scatters_per_step']} reduce-scatters, "
            f"{totals['all_gather_bytes_per_step']:,} bytes all-gathered ({totals['units']} units)",
            f"  uniform policy:       same collectives, "
            f"{alt['uniform']['all_gather_bytes_per_step']:,} bytes (kept params lose precision)",
            f"  separate fp32 units:  {alt['separate_fp32_units']['all_gathers_per_step']} "
            f"all-gathers, {alt['separate_fp32_units']['reduce_scatters_per_step']} "
            f"reduce-scatters ({alt['separate_fp32_units']['units']} units)",
        ]
        return "\n".join(lines)

    def _unit_lines(self, unit: PlannedUnit, max_params: int) -> list[str]:
        lines: list[str] = []
        ag, rs = unit.collectives_per_step()
        by_dtype = ", ".join(
            f"{k} {v:,} B" for k, v in sorted(unit.gather_bytes(self.world_size).items())
        )
        tag = " [split child, param_dtype=None]" if unit.split_child else ""
        lines.append(
            f"unit {unit.name}{tag}: {len(unit.params)} params; all-gather {by_dtype}; "
            f"{ag} all-gather{'s' if ag != 1 else ''} + {rs} reduce-scatter"
            f"{'s' if rs != 1 else ''} per step"
        )
        claimed = [p for p in unit.params if p.rule != "default"]
        for p in claimed[:max_params]:
            alias = f" (= {', '.join(p.aliases)})" if p.aliases else ""
            lines.append(
                f"    {p.fqn:<48} {dtype_name(p.storage):>8} -> {dtype_name(p.compute):<8} "
                f"by {p.rule}{alias}"
            )
        if len(claimed) > max_params:
            lines.append(f"    ... and {len(claimed) - max_params} more claimed parameters")
        others = len(unit.params) - len(claimed)
        if others:
            default = dtype_name(self.rules.param_dtype) if self.rules.param_dtype else "storage"
            lines.append(f"    {others} other parameters compute in {default}")
        return lines


def _owner(model: nn.Module, fqn: str) -> nn.Module:
    owner_name = fqn.rpartition(".")[0]
    return model.get_submodule(owner_name) if owner_name else model


def default_units(model: nn.Module) -> list[nn.Module]:
    """Every module whose class is in ``model._no_split_modules``, then the root."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    return [*blocks, model]


def compile_param_dtype_maps(
    model: nn.Module,
    rules: PrecisionRules,
    units: Sequence[UnitSpec] | None = None,
    *,
    world_size: int = 1,
) -> PrecisionPlan:
    """Compile ``rules`` into one exact map per planned ``fully_shard`` call.

    ``units`` are the modules (or lists of modules, for a grouped call) that will be passed to
    ``fully_shard``, in the order the calls will be made: innermost first, the root last. Default:
    :func:`default_units`. Each parameter is claimed by the first unit that manages it. Raises
    :class:`ParamDtypeMapError` (before anything is wrapped) for rules that match nothing,
    parameters no unit owns, ties across units, degraded kept parameters, grouped calls that
    cannot express the per-member dtypes, and layouts the ``split`` strategy cannot honour.
    """
    if not isinstance(rules, PrecisionRules):
        raise TypeError(f"rules must be a PrecisionRules, got {type(rules).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    specs = list(default_units(model) if units is None else units)
    if not specs:
        raise ValueError("units is empty; pass the modules to wrap, the root last")

    module_names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    named = list(model.named_parameters(remove_duplicate=False))
    fqns_of: dict[int, list[str]] = {}
    param_of: dict[int, nn.Parameter] = {}
    for fqn, param in named:
        fqns_of.setdefault(id(param), []).append(fqn)
        param_of[id(param)] = param

    # 1. dtype per parameter: rules in order, then declarations.
    decision_dtype = rules.param_dtype or _majority_dtype(model)
    decls = _hf.declarations(model, decision_dtype) if rules.hf_keep_in_fp32 else []
    declared = [
        DeclaredRule(source=d.source, pattern=d.pattern, fqns=d.params) for d in decls if d.params
    ]
    ordered: list[Any] = [*rules.rules, *declared]
    labels = [str(r) for r in ordered]
    claims: dict[str, list[str]] = {label: [] for label in labels}
    target: dict[int, tuple[torch.dtype, str]] = {}
    for pid, fqns in fqns_of.items():
        for rule, label in zip(ordered, labels, strict=True):
            if any(rule.matches(f, _owner(model, f)) for f in fqns):
                target[pid] = (rule.dtype, label)
                claims[label].append(fqns[0])
                break
    for rule, label in zip(rules.rules, labels, strict=False):
        if not claims[label] and not any(
            rule.matches(f, _owner(model, f)) for fqns in fqns_of.values() for f in fqns
        ):
            raise ParamDtypeMapError(
                f"precision rule {label} -> {dtype_name(rule.dtype)} matches no parameter of "
                f"{type(model).__name__}; patterns match whole root-relative FQNs "
                f"(e.g. {named[0][0]!r}); use '*' to match any prefix"
            )

    # 2. Degraded kept parameters: precision was lost before we saw the model.
    for pid, (kept_dtype, label) in target.items():
        storage = param_of[pid].dtype
        if storage.is_floating_point and storage.itemsize < kept_dtype.itemsize:
            raise ParamDtypeMapError(
                f"parameter {fqns_of[pid][0]!r} is kept in {dtype_name(kept_dtype)} by {label} "
                f"but is stored in {dtype_name(storage)}: precision was lost before "
                "fsdp_precision saw the model (a .to(dtype) or from_config(dtype=...)). "
                "Load it with from_pretrained(dtype=...) or fsdp_precision.hf."
                "cast_keeping_fp32, or build it in fp32"
            )

    # 3. Units: innermost first, each parameter claimed by the first unit that manages it.
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
    if rules.strategy == "split":
        spec_modules = (
            _split_children(model, spec_modules, target, fqns_of, param_of) + spec_modules
        )
    unit_of: dict[int, int] = {}
    planned: list[PlannedUnit] = []
    for index, mods in enumerate(spec_modules):
        names = [module_names[id(m)] for m in mods]
        unit = PlannedUnit(
            name=", ".join(n or "<root>" for n in names),
            modules=mods,
            is_root=any(m is model for m in mods),
        )
        unit.split_child = rules.strategy == "split" and index < len(spec_modules) - len(specs)
        keys: dict[str, tuple[torch.dtype | None, str]] = {}
        listed: set[int] = set()
        for m in mods:
            for local, param in m.named_parameters(remove_duplicate=False):
                pid = id(param)
                if unit_of.setdefault(pid, index) != index:
                    continue
                found = target.get(pid)
                dtype, label = found if found is not None else (None, "default")
                previous = keys.get(local)
                if previous is not None and previous[0] != dtype and len(mods) > 1:
                    raise ParamDtypeMapError(
                        f"grouped unit [{unit.name}] cannot give key {local!r} two dtypes "
                        f"({_fmt(previous[0])} by {previous[1]}, {_fmt(dtype)} by {label}): a "
                        "grouped fully_shard broadcasts each key to every member. Wrap the "
                        "members separately, or make the rules agree"
                    )
                keys[local] = (dtype, label)
                if pid in listed:  # an alias inside the same unit
                    continue
                listed.add(pid)
                storage = param.dtype
                compute = (
                    dtype or (rules.param_dtype if storage.is_floating_point else None) or storage
                )
                if unit.split_child:
                    compute = storage
                reduce = (rules.reduce_dtype or compute) if param.requires_grad else None
                unit.params.append(
                    PlannedParam(
                        fqn=fqns_of[pid][0],
                        key=local,
                        shape=tuple(param.shape),
                        storage=storage,
                        compute=compute,
                        reduce=reduce,
                        rule=label,
                        aliases=tuple(fqns_of[pid][1:]),
                    )
                )
        unit.policy = _policy_for(unit, keys, rules)
        planned.append(unit)

    unowned = [fqns[0] for pid, fqns in fqns_of.items() if pid not in unit_of]
    if unowned:
        raise ParamDtypeMapError(
            f"parameters {unowned[:5]} belong to no planned unit; FSDP would leave them "
            "unsharded. Put the root module last in units (it owns whatever is left)"
        )
    _check_ties(model, fqns_of, spec_modules, module_names)
    return PrecisionPlan(
        model=model,
        rules=rules,
        units=planned,
        declarations=decls,
        rule_claims=claims,
        world_size=world_size,
    )


def _fmt(dtype: torch.dtype | None) -> str:
    return dtype_name(dtype) if dtype is not None else "the default"


def _majority_dtype(model: nn.Module) -> torch.dtype:
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.__getitem__) if counts else torch.float32


def _policy_for(
    unit: PlannedUnit, keys: dict[str, tuple[torch.dtype | None, str]], rules: PrecisionRules
) -> MixedPrecisionPolicy:
    # A unit whose every parameter is kept (e.g. a norm or an embedder that the size rule made
    # its own unit) must not cast its inputs to param_dtype: that would move the activation
    # boundary and lose exactly the precision the rules keep.
    all_kept = bool(unit.params) and all(p.rule != "default" for p in unit.params)
    common = dict(
        reduce_dtype=rules.reduce_dtype,
        output_dtype=rules.output_dtype,
        cast_forward_inputs=rules.cast_forward_inputs and not all_kept,
    )
    if unit.split_child:
        # param_dtype=None, not float32: the activation boundary must not move.
        return MixedPrecisionPolicy(param_dtype=None, **common)  # type: ignore[arg-type]
    mapped = {k: d for k, (d, _) in keys.items() if d is not None}
    if rules.strategy == "split" or not mapped:
        return MixedPrecisionPolicy(param_dtype=rules.param_dtype, **common)  # type: ignore[arg-type]
    trainable_dtypes = {p.compute for p in unit.params if p.reduce is not None}
    if len(trainable_dtypes) > 1 and rules.reduce_dtype is None:
        raise ParamDtypeMapError(
            f"unit {unit.name} computes trainable parameters in "
            f"{sorted(dtype_name(d) for d in trainable_dtypes)} but reduce_dtype is None; set "
            "PrecisionRules(reduce_dtype=torch.float32)"
        )
    return ParamDtypeMixedPrecisionPolicy(
        param_dtype=rules.param_dtype,
        param_dtype_map=mapped,
        **common,  # type: ignore[arg-type]
    )


def _split_children(
    model: nn.Module,
    spec_modules: list[tuple[nn.Module, ...]],
    target: dict[int, tuple[torch.dtype, str]],
    fqns_of: dict[int, list[str]],
    param_of: dict[int, nn.Parameter],
) -> list[tuple[nn.Module, ...]]:
    """Kept modules as their own units (``split``), validated to hold kept parameters only."""
    children: list[tuple[nn.Module, ...]] = []
    seen: set[int] = set()
    for pid, (dtype, label) in target.items():
        fqn = fqns_of[pid][0]
        owner = _owner(model, fqn)
        if owner is model:
            raise ParamDtypeMapError(
                f"split strategy: kept parameter {fqn!r} ({label}) sits directly on the root, "
                "which has no child unit to give it; use strategy='patch' (one unit, exact map)"
            )
        if param_of[pid].dtype != dtype:
            raise ParamDtypeMapError(
                f"split strategy: {fqn!r} is kept in {dtype_name(dtype)} but stored in "
                f"{dtype_name(param_of[pid].dtype)}; a split unit computes in its storage dtype "
                "(param_dtype=None). Store it in that dtype, or use strategy='patch'"
            )
        if id(owner) in seen:
            continue
        others = [n for n, p in owner.named_parameters(recurse=False) if id(p) not in target]
        if others:
            raise ParamDtypeMapError(
                f"split strategy: module {fqn.rpartition('.')[0]!r} owns kept {fqn!r} and "
                f"non-kept {others}; a split unit cannot hold both. Use strategy='patch'"
            )
        seen.add(id(owner))
        children.append((owner,))
    return children


def _check_ties(
    model: nn.Module,
    fqns_of: dict[int, list[str]],
    spec_modules: list[tuple[nn.Module, ...]],
    module_names: dict[int, str],
) -> None:
    """A tied parameter whose aliases live under different units cannot be sharded by torch."""
    unit_prefixes = [[module_names[id(m)] for m in mods] for mods in spec_modules]

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
