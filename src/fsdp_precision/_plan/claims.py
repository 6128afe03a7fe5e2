"""Which rule claims each parameter: packed storage, then user rules, then declarations, then
the advice (``PrecisionRules(advice="apply")``).

The first rule (in that order) that matches any of a parameter's names claims it; a user rule
that claims nothing is an error, and so is a kept dtype wider than the parameter's storage.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from fsdp_precision._base.dtypes import dtype_name, exact_upcast
from fsdp_precision._base.errors import ParamDtypeMapError
from fsdp_precision._hf.declarations import Declaration
from fsdp_precision._plan.quantized import packed_storage_rules
from fsdp_precision._plan.records import RuleClaims
from fsdp_precision._policy.resolve import own_format_message
from fsdp_precision._rules.rules import (
    AdvisedRule,
    AnyRule,
    DeclaredRule,
    PrecisionRules,
    rule_label,
)

__all__ = ["Claimed", "claim_params", "fqns_by_param", "owner_of", "planned_upcasts"]

#: Parameter (by ``id``) -> (the dtype its rule asks for, the rule that claimed it).
Claimed = dict[int, tuple[torch.dtype, AnyRule]]


def fqns_by_param(model: nn.Module) -> dict[int, list[str]]:
    """Every parameter (by ``id``) and all its names, in ``named_parameters`` order."""
    fqns_of: dict[int, list[str]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        fqns_of.setdefault(id(param), []).append(fqn)
    return fqns_of


def _params_by_id(model: nn.Module) -> dict[int, nn.Parameter]:
    return {id(p): p for p in model.parameters()}


def owner_of(model: nn.Module, fqn: str) -> nn.Module:
    """The module that owns the parameter named ``fqn`` directly."""
    owner_name = fqn.rpartition(".")[0]
    return model.get_submodule(owner_name) if owner_name else model


def claim_params(
    model: nn.Module,
    rules: PrecisionRules,
    decls: Sequence[Declaration],
    fqns_of: dict[int, list[str]],
    advised: Sequence[AdvisedRule] = (),
) -> tuple[Claimed, tuple[RuleClaims, ...]]:
    """Each parameter claimed by the first rule that matches any of its names.

    Packed quantized storage first (it is never cast), then user rules, in order, then the
    model's declarations, then ``advised``. A user rule that matches nothing, or whose every
    match an earlier rule took, is an error; a shadowed declaration or advice is ordinary
    precedence (``explain()`` shows it with 0 parameters).
    """
    declared = [
        DeclaredRule(source=d.source, pattern=d.pattern, fqns=d.params) for d in decls if d.params
    ]
    packed = packed_storage_rules(model)
    first = len(packed)  # index of the first user rule in ``ordered``
    ordered: list[AnyRule] = [*packed, *rules.rules, *declared, *advised]
    owners = {f: owner_of(model, f) for fqns in fqns_of.values() for f in fqns}
    claimed: list[list[str]] = [[] for _ in ordered]
    claimed_by: Claimed = {}
    taken_by: dict[int, int] = {}  # parameter -> index of the rule that claimed it
    for pid, fqns in fqns_of.items():
        for index, rule in enumerate(ordered):
            if any(rule.matches(f, owners[f]) for f in fqns):
                claimed_by[pid] = (rule.dtype, rule)
                claimed[index].append(fqns[0])
                taken_by[pid] = index
                break
    params = _params_by_id(model)
    for pid, (_, rule) in claimed_by.items():
        if hasattr(params[pid], "fsdp_pre_all_gather"):
            raise ParamDtypeMapError(
                f"{rule_label(rule)} claims a parameter it cannot keep: "
                + own_format_message(fqns_of[pid][0], params[pid])
            )
    example = next(iter(owners), "")
    for index, rule in enumerate(rules.rules, start=first):
        if claimed[index]:
            continue
        matched = [
            pid for pid, fqns in fqns_of.items() if any(rule.matches(f, owners[f]) for f in fqns)
        ]
        label = f"precision rule {rule_label(rule)} -> {dtype_name(rule.dtype)}"
        if not matched:
            raise ParamDtypeMapError(
                f"{label} matches no parameter of {type(model).__name__}; patterns match whole "
                f"root-relative FQNs (e.g. {example!r}); use '*' to match any prefix"
            )
        earlier = sorted({taken_by[pid] for pid in matched})
        names = ", ".join(
            f"{f'rules[{i - first}] ' if i >= first else ''}{rule_label(ordered[i])} -> "
            f"{dtype_name(ordered[i].dtype)}"
            for i in earlier
        )
        raise ParamDtypeMapError(
            f"{label} (rules[{index - first}]) claims no parameter: every parameter it matches "
            f"({len(matched)}, e.g. {fqns_of[matched[0]][0]!r}) was claimed first by {names} "
            "(first match wins). Remove it, or move it before the rule(s) it should override"
        )
    return claimed_by, tuple(
        RuleClaims(
            rule=rule, fqns=tuple(fqns), declared=not first <= index < first + len(rules.rules)
        )
        for index, (rule, fqns) in enumerate(zip(ordered, claimed, strict=True))
    )


def planned_upcasts(
    model: nn.Module, claimed: Claimed, fqns_of: dict[int, list[str]]
) -> dict[int, torch.dtype]:
    """``id(parameter) -> kept dtype`` of every parameter a user rule keeps wider than it is
    stored, upcast exactly when the plan is applied (:mod:`fsdp_precision._plan.upcast`).

    Raises :class:`ParamDtypeMapError` for a model declaration stored narrower than it
    declares (precision was lost before the model reached this library: a correct load keeps
    it), and for a user rule whose dtype cannot hold every stored value.
    """
    upcasts: dict[int, torch.dtype] = {}
    for param in model.parameters():
        entry = claimed.get(id(param))
        if entry is None or not param.is_floating_point():
            continue
        kept, rule = entry
        if param.dtype.itemsize >= kept.itemsize:
            continue
        fqn = fqns_of[id(param)][0]
        if isinstance(rule, DeclaredRule):
            raise _lost(fqn, rule, kept, param.dtype)
        if not exact_upcast(param.dtype, kept):
            raise ParamDtypeMapError(
                f"parameter {fqn!r} is stored in {dtype_name(param.dtype)} and {rule_label(rule)} "
                f"keeps it in {dtype_name(kept)}, which cannot hold every "
                f"{dtype_name(param.dtype)} value exactly; keep it in a dtype that can "
                "(torch.float32), or in its storage dtype"
            )
        upcasts[id(param)] = kept
    return upcasts


def _lost(fqn: str, rule: AnyRule, kept: torch.dtype, storage: torch.dtype) -> ParamDtypeMapError:
    return ParamDtypeMapError(
        f"parameter {fqn!r} is kept in {dtype_name(kept)} by {rule_label(rule)} but is stored "
        f"in {dtype_name(storage)}: precision was lost before fsdp_precision saw the model (a "
        f".to(torch.{dtype_name(storage)}), from_config(dtype=...) or a state dict loaded into "
        f"a {dtype_name(storage)} model); a correct load keeps it. Fixes: load with "
        f"from_pretrained(..., dtype=torch.{dtype_name(storage)}) and do not cast the model "
        "afterwards (it keeps the declared parameters); or build or load the model in "
        f"float32 and call fsdp_precision.hf.cast_keeping_fp32(model, "
        f"torch.{dtype_name(storage)}, rules=rules); or, if the checkpoint itself stores it in "
        f"{dtype_name(storage)} (nothing was lost), add the user rule Glob({fqn!r}) "
        "(user rules come first), which upcasts it exactly"
    )
