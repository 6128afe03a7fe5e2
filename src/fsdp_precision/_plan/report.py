"""Reporting a plan: ``explain()`` (a human table), ``to_dict()`` (JSON) and the alternatives.

Display labels of rules are made here only; the plan keys its claims by rule identity.
"""

from __future__ import annotations

from typing import Any

from fsdp_precision._base.dtypes import dtype_name, optional_name
from fsdp_precision._base.errors import ParamDtypeMapError
from fsdp_precision._plan import cost
from fsdp_precision._plan.data import PlanData, claim_labels
from fsdp_precision._plan.meshes import Meshes, mesh_lines, mesh_totals
from fsdp_precision._plan.records import PlannedUnit
from fsdp_precision._plan.separate import separate_units_plan
from fsdp_precision._rules.rules import rule_label

__all__ = ["alternatives", "explain", "to_dict"]


def alternatives(plan: PlanData) -> dict[str, dict[str, Any]]:
    """The same model under a uniform policy and under separate units (same cost model)."""
    base = plan.totals()
    uniform_bytes = 0
    default = plan.rules.param_dtype
    for unit in plan.units:
        gathers = plan.collectives(unit).all_gathers
        uniform_bytes += gathers * sum(
            p.padded_numel(plan.world_size) * (default or p.storage).itemsize for p in unit.params
        )
    note = "each module owning a mapped parameter as its own unit, in the dtype it is kept in"
    try:
        separate_plan = separate_units_plan(plan)
        separate = {
            **separate_plan.totals(),
            "compiled_graph_breaks": cost.compiled_graph_breaks(separate_plan.units),
        }
    except ParamDtypeMapError as exc:
        separate = dict.fromkeys([*base, "compiled_graph_breaks"])
        note = str(exc)
    return {
        "uniform": {
            **base,
            "all_gather_bytes_per_step": uniform_bytes,
            "note": "every parameter in param_dtype: kept parameters lose precision",
        },
        "separate_units": {**separate, "note": note},
    }


def _unit_dict(plan: PlanData, u: PlannedUnit) -> dict[str, Any]:
    counts = plan.collectives(u)
    return {
        "name": u.name,
        "modules": len(u.modules),
        "separate_unit": u.separate_unit,
        "policy": {
            "param_dtype": optional_name(u.policy.param_dtype),
            "reduce_dtype": optional_name(u.policy.reduce_dtype),
            "param_dtype_map": {k: optional_name(v) for k, v in u.param_dtype_map.items()},
        },
        "module_casts": {
            fqn: {"inputs": dtype_name(c.inputs), "outputs_cast_back": c.outputs}
            for fqn, c in u.module_casts.items()
        },
        "uncast_inputs": sorted(u.uncast_inputs),
        "all_gather_bytes_by_dtype": u.gather_bytes(plan.world_size),
        "collectives_per_step": {
            "all_gathers": counts.all_gathers,
            "reduce_scatters": counts.reduce_scatters,
            "all_reduces": counts.all_reduces,
        },
        "params": [
            {
                "fqn": p.fqn,
                "key": p.key,
                "shape": list(p.shape),
                "storage": optional_name(p.storage),
                "compute": optional_name(p.compute),
                "reduce": optional_name(p.reduce),
                "rule": rule_label(p.claimed_by),
                "aliases": list(p.aliases),
                "upcast_from": optional_name(p.upcast_from),
            }
            for p in u.params
        ],
    }


def to_dict(plan: PlanData, *, meshes: Meshes | None = None) -> dict[str, Any]:
    """JSON-ready form of the plan; with ``meshes``, their totals under ``"meshes"``."""
    return {
        "model": type(plan.model).__name__,
        "rules": plan.rules.describe(),
        "fallback": plan.fallback,
        "world_size": plan.world_size,
        "reshard_after_forward": plan.reshard_after_forward,
        "hsdp": plan.hsdp,
        "units": [_unit_dict(plan, u) for u in plan.units],
        "rule_claims": {label: len(c.fqns) for label, c in claim_labels(plan.claims)},
        "declarations": [
            {
                "source": d.source,
                "pattern": d.pattern,
                "params": sorted(d.params),
                "buffers": sorted(d.buffers),
            }
            for d in plan.declarations
        ],
        "replicated": [
            {"fqn": p.fqn, "storage": optional_name(p.storage), "trainable": p.reduce is not None}
            for p in plan.replicated
        ],
        "not_units": [
            {"module": s.module, "reason": s.reason}
            for s in (plan.unit_choice.skipped if plan.unit_choice else ())
        ],
        "parameter_uses": plan.unit_choice.traced if plan.unit_choice else None,
        "advice": plan.advice.to_dict() if plan.advice is not None else None,
        "totals": plan.totals(),
        "meshes": mesh_totals(plan, meshes) if meshes is not None else None,
        "alternatives": alternatives(plan),
    }


def explain(plan: PlanData, *, max_params: int = 12, meshes: Meshes | None = None) -> str:
    """Per unit, who claimed what, bytes per all-gather, collectives; then the rules; with
    ``meshes``, per pipeline stage and rank beside FSDP."""
    lines = [
        f"precision plan for {type(plan.model).__name__} ({plan.rules.describe()})",
        f"world size {plan.world_size} (bytes include FSDP's dim-0 padding)",
        *([f"public-API layout: {plan.fallback}"] if plan.fallback else []),
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

    for unit in plan.units:
        if not unit.params:
            continue
        signature = (
            tuple(
                (p.key, p.storage, p.compute, type(p.claimed_by), p.upcast_from)
                for p in unit.params
            ),
            tuple(_relative_casts(unit).items()),
            unit.separate_unit,
            unit.is_root,
        )
        if signature == previous:
            repeats.append(unit.name)
            continue
        flush()
        previous = signature
        lines.extend(_unit_lines(plan, unit, max_params))
    flush()
    lines.extend(_placement_lines(plan))
    lines.append("")
    lines.append("rules (first match wins):")
    for label, claim in claim_labels(plan.claims):
        fqns = claim.fqns
        sample = ", ".join(fqns[:3]) + (", ..." if len(fqns) > 3 else "")
        lines.append(f"    {label}: {len(fqns)} parameters{': ' + sample if fqns else ''}")
    for d in plan.declarations:
        if not d.params:
            what = f"buffers only: {', '.join(sorted(d.buffers)[:3])}" if d.buffers else "nothing"
            lines.append(f"    {d.source} {d.pattern!r}: matches {what}")
    totals, alt = plan.totals(), alternatives(plan)
    separate = alt["separate_units"]
    lines += [
        "",
        f"per step: {totals['all_gathers_per_step']} all-gathers, "
        f"{totals['reduce_scatters_per_step']} reduce-scatters, "
        + (
            f"{totals['all_reduces_per_step']} all-reduce"
            f"{'s' if totals['all_reduces_per_step'] != 1 else ''}, "
            if plan.hsdp or plan.replicated
            else ""
        )
        + f"{totals['all_gather_bytes_per_step']:,} bytes all-gathered ({totals['units']} units)",
        f"  uniform policy:       same collectives, "
        f"{alt['uniform']['all_gather_bytes_per_step']:,} bytes (kept params lose precision)",
        f"  separate units:       {separate['all_gathers_per_step']} all-gathers, "
        f"{separate['reduce_scatters_per_step']} reduce-scatters ({separate['units']} units); "
        f"{separate['compiled_graph_breaks']} graph breaks per forward with compiled blocks "
        f"(this plan: {cost.compiled_graph_breaks(plan.units)})"
        if separate["units"] is not None
        else f"  separate units:       not possible: {separate['note']}",
    ]
    if meshes is not None and not meshes.trivial:
        lines += ["", *mesh_lines(plan, meshes)]
    if plan.advice is not None:
        lines += ["", plan.advice.explain()]
    return "\n".join(lines)


def _placement_lines(plan: PlanData) -> list[str]:
    """The replicated 0-dim parameters and the modules refused as units, with the reasons."""
    lines: list[str] = []
    if plan.replicated:
        lines.append(
            "replicated (0-dim: in no unit, whole on every rank, computing in their storage "
            "dtype; each trainable one's gradient averaged by one all-reduce per step):"
        )
        lines.extend(f"    {p.fqn:<48} {dtype_name(p.storage):>8}" for p in plan.replicated)
    choice = plan.unit_choice
    if choice is not None and choice.skipped:
        lines.append("not units (selected by the wrap policy; torch could not run them as units):")
        lines.extend(f"    {s.module}: {s.reason}" for s in choice.skipped)
    if choice is not None:
        lines.append(f"parameter uses: {choice.traced}")
    return lines


def _unit_lines(plan: PlanData, unit: PlannedUnit, max_params: int) -> list[str]:
    counts = plan.collectives(unit)
    ag, rs = counts.all_gathers, counts.reduce_scatters
    by_dtype = ", ".join(
        f"{k} {v:,} B" for k, v in sorted(unit.gather_bytes(plan.world_size).items())
    )
    tag = ""
    if unit.separate_unit:
        tag = f" [separate unit, param_dtype={optional_name(unit.policy.param_dtype)}]"
    lines = [
        f"unit {unit.name}{tag}: {len(unit.params)} params; all-gather {by_dtype}; "
        f"{ag} all-gather{'s' if ag != 1 else ''} + {rs} reduce-scatter"
        f"{'s' if rs != 1 else ''} per step"
    ]
    claimed = [p for p in unit.params if p.claimed_by is not None]
    for p in claimed[:max_params]:
        alias = f" (= {', '.join(p.aliases)})" if p.aliases else ""
        upcast = (
            f" (stored in {dtype_name(p.upcast_from)}: upcast exactly when applied)"
            if p.upcast_from is not None
            else ""
        )
        lines.append(
            f"    {p.fqn:<48} {dtype_name(p.storage):>8} -> {dtype_name(p.compute):<8} "
            f"by {rule_label(p.claimed_by)}{alias}{upcast}"
        )
    if len(claimed) > max_params:
        lines.append(f"    ... and {len(claimed) - max_params} more claimed parameters")
    others = len(unit.params) - len(claimed)
    if others:
        default = dtype_name(plan.rules.param_dtype) if plan.rules.param_dtype else "storage"
        lines.append(f"    {others} other parameters compute in {default}")
    for fqn, cast in list(unit.module_casts.items())[:max_params]:
        lines.append(f"    boundary cast at {fqn}: {cast}")
    if len(unit.module_casts) > max_params:
        lines.append(f"    ... and {len(unit.module_casts) - max_params} more boundary casts")
    if unit.uncast_inputs:
        lines.append(f"    inputs left uncast: {', '.join(sorted(unit.uncast_inputs))}")
    return lines


def _relative_casts(unit: PlannedUnit) -> dict[str, str]:
    """The unit's casts by name under its first module (units of repeated blocks compare)."""
    prefix = unit.name.split(", ")[0]
    prefix = "" if prefix == "<root>" else f"{prefix}."
    return {fqn.removeprefix(prefix): str(c) for fqn, c in unit.module_casts.items()}
