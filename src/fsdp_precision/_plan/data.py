"""The plan's data: the planned ``fully_shard`` calls of one model and what can be read from
them (the index of planned parameters, boundary casts, upcasts, the advice, the collective
counts).

:class:`PlanData` knows nothing of what is done with a plan: checking it before the first call
(``preflight``), laying it out on meshes (``meshes``), reporting it (``report``) and the separate-
units layout (``separate``) read it from below, and :class:`~fsdp_precision._plan.plan.
PrecisionPlan` (the public class) adds those verbs on top, so the floor has no circle.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch.nn as nn

from fsdp_precision._advise.advice import PrecisionAdvice, advise
from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._hf.declarations import Declaration
from fsdp_precision._plan import cost
from fsdp_precision._plan.records import PlannedParam, PlannedUnit, RuleClaims
from fsdp_precision._plan.units import UnitChoice
from fsdp_precision._policy.casts import ModuleCast
from fsdp_precision._rules.rules import PrecisionRules, rule_label

__all__ = ["Layout", "PlanData", "claim_labels"]

#: Where parameters kept in another dtype go: ``"in_unit"``, inside their units, one exact map per
#: call (the patch, or torch 2.15's native override); ``"separate_units"``, every module that
#: holds them its own unit, public API only, more collectives.
Layout = Literal["in_unit", "separate_units"]


def claim_labels(claims: Iterable[RuleClaims]) -> list[tuple[str, RuleClaims]]:
    """A distinct display label per rule: its label, with its dtype (and position) if needed."""
    claims = list(claims)
    plain = [rule_label(c.rule) for c in claims]
    typed = [
        f"{label} -> {dtype_name(c.rule.dtype)}" for label, c in zip(plain, claims, strict=True)
    ]

    def label(i: int) -> str:
        if plain.count(plain[i]) == 1:
            return plain[i]
        return typed[i] if typed.count(typed[i]) == 1 else f"{typed[i]} (#{i})"

    labels = [label(i) for i in range(len(claims))]
    return list(zip(labels, claims, strict=True))


@dataclass(frozen=True)
class PlanData:
    """What :class:`~fsdp_precision._plan.plan.PrecisionPlan` holds (its attributes are
    documented there), and what is read from it."""

    model: nn.Module
    rules: PrecisionRules
    units: tuple[PlannedUnit, ...]
    declarations: tuple[Declaration, ...]
    claims: tuple[RuleClaims, ...]
    world_size: int = 1
    reshard_after_forward: bool | int | None = None
    hsdp: bool = False
    replicated: tuple[PlannedParam, ...] = ()
    unit_choice: UnitChoice | None = None
    found_advice: PrecisionAdvice | None = None
    fallback: str | None = None
    layout: Layout = "in_unit"

    # ----------------------------------------------------------------- reading

    @functools.cached_property
    def params_by_fqn(self) -> dict[str, PlannedParam]:
        """Every planned parameter under each of its names (aliases included), the replicated
        0-dim ones too."""
        params = [*(p for u in self.units for p in u.params), *self.replicated]
        return {fqn: p for p in params for fqn in (p.fqn, *p.aliases)}

    @functools.cached_property
    def unit_names(self) -> dict[str, str]:
        """Each planned parameter's names (aliases included) -> the name of its unit."""
        return {fqn: u.name for u in self.units for p in u.params for fqn in (p.fqn, *p.aliases)}

    @functools.cached_property
    def module_casts(self) -> dict[str, ModuleCast]:
        """Root-relative module FQN -> the boundary cast of every module a unit keeps whole."""
        return {fqn: cast for unit in self.units for fqn, cast in unit.module_casts.items()}

    @property
    def upcasts(self) -> tuple[PlannedParam, ...]:
        """The parameters whose storage :meth:`apply` upcasts exactly to the dtype a user rule
        keeps them in (``PlannedParam.upcast_from``: a bf16 checkpoint's router kept in fp32)."""
        return tuple(p for u in self.units for p in u.params if p.upcast_from is not None)

    @functools.cached_property
    def advice(self) -> PrecisionAdvice | None:
        """The precision advisor's findings among the parameters this plan computes in a
        dtype narrower than fp32 (``None`` with ``PrecisionRules(advice="off")``): traced from
        the model's forward (its ``dummy_inputs``) when first read, before :meth:`apply`."""
        if self.rules.advice == "off":
            return None
        found = self.found_advice if self.found_advice is not None else advise(self.model)
        low = [
            fqn
            for fqn, p in self.params_by_fqn.items()
            if p.compute is not None and p.compute.itemsize < 4
        ]
        return found.only(low)

    @property
    def rule_claims(self) -> dict[str, list[str]]:
        """Display form of :attr:`claims`: rule label -> claimed FQNs."""
        return {label: list(c.fqns) for label, c in claim_labels(self.claims)}

    @property
    def knobs(self) -> cost.Knobs:
        """The FSDP knobs the collective counts follow."""
        return cost.Knobs(reshard_after_forward=self.reshard_after_forward, hsdp=self.hsdp)

    # ----------------------------------------------------------------- counting

    def collectives(self, unit: PlannedUnit) -> cost.Collectives:
        """Collectives of ``unit`` in one forward+backward under the plan's knobs."""
        return cost.unit_collectives(unit, self.knobs)

    def totals(self) -> dict[str, Any]:
        """Units, collectives per step and bytes all-gathered per step, for this plan."""
        totals = cost.totals(self.units, self.world_size, self.knobs)
        # The trainable replicated (0-dim) parameters: one flat gradient all-reduce per storage
        # dtype (and data-parallel mesh dimension) per backward (replicated.average_gradients).
        totals["all_reduces_per_step"] += len(
            {p.storage for p in self.replicated if p.reduce is not None}
        )
        return totals
