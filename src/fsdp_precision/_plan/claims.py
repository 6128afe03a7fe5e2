"""Which rule claims each parameter: packed storage, then user rules, then declarations.

The first rule (in that order) that matches any of a parameter's names claims it; a user rule
that claims nothing is an error, and so is a kept dtype wider than the parameter's storage.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._base.errors import ParamDtypeMapError
from fsdp_precision._hf.declarations import Declaration
from fsdp_precision._plan.quantized import packed_storage_rules
from fsdp_precision._plan.records import RuleClaims
from fsdp_precision._plan.rules import AnyRule, DeclaredRule, PrecisionRules, rule_label

__all__ = ["Claimed", "check_not_degraded", "claim_params", "fqns_by_param", "owner_of"]

#: Parameter (by ``id``) -> (the dtype its rule asks for, the rule that claimed it).
Claimed = dict[int, tuple[torch.dtype, AnyRule]]


def fqns_by_param(model: nn.Module) -> dict[int, list[str]]:
    """Every parameter (by ``id``) and all its names, in ``named_parameters`` order."""
    fqns_of: dict[int, list[str]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        fqns_of.setdefault(id(param), []).append(fqn)
    return fqns_of


def owner_of(model: nn.Module, fqn: str) -> nn.Module:
    """The module that owns the parameter named ``fqn`` directly."""
    owner_name = fqn.rpartition(".")[0]
    return model.get_submodule(owner_name) if owner_name else model


def claim_params(
    model: nn.Module,
    rules: PrecisionRules,
    decls: Sequence[Declaration],
    fqns_of: dict[int, list[str]],
) -> tuple[Claimed, tuple[RuleClaims, ...]]:
    """Each parameter claimed by the first rule that matches any of its names.

    Packed quantized storage first (it is never cast), then user rules, in order, then the
    model's declarations. A user rule that matches nothing, or whose every match an earlier rule
    took, is an error; a shadowed declaration is ordinary precedence (``explain()`` shows it with
    0 parameters).
    """
    declared = [
        DeclaredRule(source=d.source, pattern=d.pattern, fqns=d.params) for d in decls if d.params
    ]
    packed = packed_storage_rules(model)
    first = len(packed)  # index of the first user rule in ``ordered``
    ordered: list[AnyRule] = [*packed, *rules.rules, *declared]
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


def check_not_degraded(fqn: str, rule: AnyRule, kept: torch.dtype, storage: torch.dtype) -> None:
    if storage.is_floating_point and storage.itemsize < kept.itemsize:
        raise ParamDtypeMapError(
            f"parameter {fqn!r} is kept in {dtype_name(kept)} by {rule_label(rule)} "
            f"but is stored in {dtype_name(storage)}: precision was lost before "
            "fsdp_precision saw the model (a .to(dtype) or from_config(dtype=...)). "
            "Load it with from_pretrained(dtype=...) or fsdp_precision.hf."
            "cast_keeping_fp32, or build it in fp32"
        )
