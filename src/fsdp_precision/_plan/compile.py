"""The planning verb: compile precision rules into one exact map per planned ``fully_shard`` call.

The plan is computed from the model alone (meta-device models work: only shapes, dtypes and
structure are read) and validated before anything is wrapped. Every record is built once,
complete (:mod:`fsdp_precision._plan.build`); :meth:`PrecisionPlan.apply` then makes the calls in
order.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Literal

import torch
import torch.nn as nn

from fsdp_precision._advise.advice import PrecisionAdvice, advise, advised_rules
from fsdp_precision._base.dist import is_rank0
from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._base.errors import ParamDtypeMapError
from fsdp_precision._hf.declarations import declarations
from fsdp_precision._plan.build import UnitSpec, build_units
from fsdp_precision._plan.claims import Claimed, claim_params, fqns_by_param, planned_upcasts
from fsdp_precision._plan.data import Layout
from fsdp_precision._plan.plan import PrecisionPlan
from fsdp_precision._plan.records import PlannedParam
from fsdp_precision._plan.replicated import replicated_params
from fsdp_precision._plan.separate import separate_units_plan
from fsdp_precision._plan.tops import remember_inputs
from fsdp_precision._plan.units import default_units
from fsdp_precision._releases.status import patch_status
from fsdp_precision._rules.rules import PrecisionRules, rule_label

__all__ = ["LAYOUTS", "UNKNOWN_TORCH", "Layout", "UnknownTorch", "compile_param_dtype_maps"]

#: What ``units`` holds: a module, or a list of modules for a grouped call.
Unit = nn.Module | Sequence[nn.Module]

LAYOUTS: tuple[Layout, ...] = ("in_unit", "separate_units")

logger = logging.getLogger(__name__)
#: What to do on a torch the patch does not know (a release without a release module, or one
#: whose upstream sources differ): ``"refuse"`` (``apply()`` raises, naming what differs and
#: this option), or ``"public_api"``: plan the separate-units layout, which needs no patch
#: (bitwise the same numerics, more collectives), with a warning saying why and what it costs.
UnknownTorch = Literal["refuse", "public_api"]
UNKNOWN_TORCH: tuple[UnknownTorch, ...] = ("refuse", "public_api")


def compile_param_dtype_maps(
    model: nn.Module,
    rules: PrecisionRules,
    units: Sequence[Unit] | None = None,
    *,
    layout: Layout | None = None,
    world_size: int = 1,
    reshard_after_forward: bool | int | None = None,
    hsdp: bool = False,
    example_inputs: object = None,
    unknown_torch: UnknownTorch = "refuse",
    advice: PrecisionAdvice | None = None,
) -> PrecisionPlan:
    """Compile ``rules`` into one exact map per planned ``fully_shard`` call.

    ``units`` are the modules (or lists of modules, for a grouped call) that will be passed to
    ``fully_shard``, in the order the calls will be made: innermost first, the root last. Default:
    :func:`default_units`. Each parameter is claimed by the first unit that manages it.
    ``layout`` says where parameters that compute in another dtype go: ``"in_unit"`` (default:
    inside their units, one all-gather and one reduce-scatter per unit) or ``"separate_units"``
    (each module holding them its own unit, public API only). ``world_size`` (shards per unit),
    ``reshard_after_forward`` (as passed to ``fully_shard``) and ``hsdp`` (a 2-D replicate x
    shard mesh) shape the collective counts and bytes the plan reports;
    :meth:`PrecisionPlan.apply` passes the plan's ``reshard_after_forward``.
    ``example_inputs`` (a mapping of keyword arguments, a tuple or one tensor) feed the
    precision advisor's traced forward (``PrecisionRules.advice``), which then runs here;
    without them it runs on the model's ``dummy_inputs``, here with ``advice="apply"`` or
    ``"measured"``, else when :attr:`PrecisionPlan.advice` is first read. With
    ``advice="measured"`` the inputs may be a list of batches, the calibration data the
    measurement runs on (:func:`advise` with ``measure=True``). The same inputs (or the
    ``dummy_inputs``) tell, where a module's children hold kept parameters, whether that
    module's own forward runs around their uses: its boundary cast and, in the separate-units
    layout, its unit go there only if it does (traced once, when first needed).
    ``unknown_torch="public_api"``:
    where the patch cannot run on the installed torch (:data:`UNKNOWN_TORCH`), plan the
    separate-units layout instead, and say so (``plan.fallback``, a warning with the extra
    collectives).
    ``advice``: the advisor's findings for this model, found already (:func:`advise`, with a
    ``stand_in`` where the model's own forward cannot run on the meta device): used as they
    are, nothing traced again.

    Raises :class:`ParamDtypeMapError` (before anything is wrapped) for rules that match nothing,
    user rules that earlier rules fully shadow, parameters no unit owns, ties across units,
    degraded kept parameters, grouped calls that cannot express the per-member dtypes, and
    layouts that separate units cannot express; ``ValueError`` for bad knobs.
    """
    if not isinstance(rules, PrecisionRules):
        raise TypeError(f"rules must be a PrecisionRules, got {type(rules).__name__}")
    layout = _layout(layout, rules)
    _check_knobs(world_size, reshard_after_forward, hsdp)
    if unknown_torch not in UNKNOWN_TORCH:
        raise ValueError(
            f"unknown_torch must be 'refuse' or 'public_api', got {unknown_torch!r}: 'public_api' "
            "plans separate units where the patch cannot run on the installed torch"
        )
    status = patch_status() if unknown_torch == "public_api" else None
    fallback = status.reason() if status is not None and not status.usable else None
    specs = list(default_units(model) if units is None else units)
    if not specs:
        raise ValueError("units is empty; pass the modules to wrap, the root last")

    fqns_of = fqns_by_param(model)
    decision_dtype = rules.param_dtype or _majority_dtype(model)
    decls = tuple(declarations(model, decision_dtype) if rules.hf_keep_in_fp32 else ())
    applied = rules.advice in ("apply", "measured")
    traced = applied or (rules.advice == "report" and example_inputs is not None)
    found = advice
    measured = rules.advice == "measured"
    if traced and (found is None or (measured and found.measured is None)):
        dtype = rules.param_dtype or torch.bfloat16
        found = advise(model, example_inputs, measure=measured, dtype=dtype)
    threshold = rules.advice_threshold if measured else None
    batches = example_inputs if measured and isinstance(example_inputs, list) else None
    remember_inputs(model, batches[0] if batches else example_inputs)  # for the topmost rule
    advised = advised_rules(found, threshold=threshold) if found is not None and applied else ()
    claimed, claims = claim_params(model, rules, decls, fqns_of, advised)
    upcasts = planned_upcasts(model, claimed, fqns_of)

    module_ids = {id(m) for _, m in model.named_modules(remove_duplicate=False)}
    spec_modules = [
        (tuple(s) if isinstance(s, Sequence) and not isinstance(s, nn.Module) else (s,))
        for s in specs
    ]
    for mods in spec_modules:
        for m in mods:
            if id(m) not in module_ids:
                raise ParamDtypeMapError(
                    f"unit module {type(m).__name__} is not a submodule of the model"
                )
    in_unit = layout == "in_unit"
    planned = build_units(
        model,
        rules,
        [UnitSpec(mods) for mods in spec_modules],
        claimed,
        maps=in_unit,
        upcasts=upcasts,
    )
    plan = PrecisionPlan(
        replicated=_replicated(model, claimed, fqns_of),
        model=model,
        rules=rules,
        units=planned,
        declarations=decls,
        claims=claims,
        world_size=world_size,
        reshard_after_forward=reshard_after_forward,
        hsdp=hsdp,
        found_advice=found,
    )
    if fallback is not None:
        return _fall_back(plan, fallback)
    return plan if in_unit else separate_units_plan(plan)


def _fall_back(in_unit: PrecisionPlan, reason: str) -> PrecisionPlan:
    """The public-API layout of ``in_unit`` if it needs the patch, with the warning."""
    if not any(u.param_dtype_map or u.module_casts for u in in_unit.units):
        return in_unit  # nothing kept: no patch needed, nothing changes
    separate = separate_units_plan(in_unit)
    extra = {
        k: separate.totals()[k] - in_unit.totals()[k]
        for k in ("all_gathers_per_step", "reduce_scatters_per_step", "units")
    }
    note = (
        f"{reason}; planned the public-API layout instead (each kept module its own "
        f"fully_shard unit): {extra['units']} more units, {extra['all_gathers_per_step']} more "
        f"all-gathers and {extra['reduce_scatters_per_step']} more reduce-scatters per step"
    )
    if is_rank0():
        logger.warning("fsdp_precision: %s", note)
    return replace(separate, fallback=note)


def _layout(layout: object, rules: PrecisionRules) -> Layout:
    if layout is None:  # PrecisionRules.strategy, deprecated, still chooses for one release
        return "separate_units" if rules.strategy == "split" else "in_unit"
    if layout not in LAYOUTS:
        raise ValueError(
            f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}: 'in_unit' "
            "keeps parameters inside their units, 'separate_units' gives each module holding "
            "them its own unit"
        )
    if rules.strategy is not None and (rules.strategy == "split") != (layout == "separate_units"):
        raise ValueError(
            f"PrecisionRules(strategy={rules.strategy!r}) contradicts layout={layout!r}; drop "
            "the deprecated strategy and pass only layout"
        )
    return layout


def _replicated(
    model: nn.Module, claimed: Claimed, fqns_of: dict[int, list[str]]
) -> tuple[PlannedParam, ...]:
    """The 0-dim parameters: in no unit, replicated, computing in their storage dtype."""
    planned = []
    for fqn, param in replicated_params(model):
        kept, rule = claimed.get(id(param), (None, None))
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


def _majority_dtype(model: nn.Module) -> torch.dtype:
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.__getitem__) if counts else torch.float32
