"""The plan's records: planned parameters, planned ``fully_shard`` calls and the plan itself.

Every record is immutable: :mod:`fsdp_precision._compile` builds them once, complete.
Reporting (``explain``, ``to_dict``) lives in :mod:`fsdp_precision._report`, the collective
counts in :mod:`fsdp_precision._cost`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_precision import _cost, _hf
from fsdp_precision._policy import ParamDtypeMixedPrecisionPolicy
from fsdp_precision._rules import AnyRule, PrecisionRules, rule_label
from fsdp_precision._units import UnitChoice

__all__ = ["PlannedParam", "PlannedUnit", "PrecisionPlan", "RuleClaims"]


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
        claimed_by: The rule object that claimed it (a ``Glob``, a ``ModuleClass`` or a model
            declaration), ``None`` when no rule did. Compare by identity. (Default: ``None``)
        aliases: Other FQNs of the same (tied) parameter. (Default: ``()``)
        mapped: Its unit's exact map has an entry for it: a rule claimed it for a dtype the
            unit would not compute it in otherwise, or the unit mixes trainable storage dtypes
            (which only a mapped unit can). (Default: ``False``)
    """

    fqn: str
    key: str
    shape: tuple[int, ...]
    storage: torch.dtype
    compute: torch.dtype
    reduce: torch.dtype | None
    claimed_by: AnyRule | None = None
    aliases: tuple[str, ...] = ()
    mapped: bool = False

    @property
    def kept(self) -> bool:
        """Whether a rule claimed it."""
        return self.claimed_by is not None

    @property
    def rule(self) -> str:
        """Display label of ``claimed_by`` (``"default"`` when no rule claimed it)."""
        return rule_label(self.claimed_by)

    @property
    def numel(self) -> int:
        """Number of elements."""
        return int(torch.Size(self.shape).numel())

    def padded_numel(self, world_size: int) -> int:
        """Numel after FSDP's dim-0 padding for ``world_size`` shards."""
        if not self.shape:
            return world_size
        dim0 = -(-self.shape[0] // world_size) * world_size
        return int(dim0 * torch.Size(self.shape[1:]).numel())


@dataclass(frozen=True)
class PlannedUnit:
    """One planned ``fully_shard`` call.

    Attributes:
        name: Module FQN(s) of the call, comma-separated (``"<root>"`` for the root).
        modules: The module(s) passed to ``fully_shard``.
        params: The parameters this call manages, in ``named_parameters`` order.
        policy: Its ``mp_policy``.
        is_root: Whether the root module is a member.
        split_child: A kept module made its own unit (separate units, ``strategy="split"``).
            (Default: ``False``)
    """

    name: str
    modules: tuple[nn.Module, ...]
    params: tuple[PlannedParam, ...]
    policy: MixedPrecisionPolicy
    is_root: bool
    split_child: bool = False

    @property
    def param_dtype_map(self) -> dict[str, torch.dtype]:
        """The exact map of the call (empty for a plain ``MixedPrecisionPolicy``)."""
        policy = self.policy
        if isinstance(policy, ParamDtypeMixedPrecisionPolicy):
            return dict(policy.param_dtype_map or {})
        return {}

    def gather_bytes(self, world_size: int = 1) -> dict[str, int]:
        """Bytes of one all-gather of this unit, by compute dtype (with dim-0 padding)."""
        return _cost.gather_bytes(self.params, world_size)

    @property
    def trainable(self) -> bool:
        """Whether any parameter has a gradient to reduce."""
        return any(p.reduce is not None for p in self.params)

    def collectives_per_step(
        self, reshard_after_forward: bool | int | None = None, *, hsdp: bool = False
    ) -> tuple[int, int]:
        """(all-gathers, reduce-scatters) of one forward+backward under these FSDP knobs.

        The defaults are FSDP's: ``reshard_after_forward=None`` (every unit but the root
        reshards after forward), a 1-D mesh. :meth:`PrecisionPlan.collectives` also counts the
        all-reduces of HSDP.
        """
        counts = _cost.unit_collectives(
            self, _cost.Knobs(reshard_after_forward=reshard_after_forward, hsdp=hsdp)
        )
        return (counts.all_gathers, counts.reduce_scatters)


@dataclass(frozen=True)
class RuleClaims:
    """What one rule claimed, in precedence order.

    Attributes:
        rule: The rule (a user rule or a model declaration).
        fqns: The parameters it claimed (first alias of each).
        declared: Whether it is a model's own declaration (not a user rule).
    """

    rule: AnyRule
    fqns: tuple[str, ...]
    declared: bool


@dataclass(frozen=True)
class PrecisionPlan:
    """The compiled plan: units in ``fully_shard`` order (innermost first, root last).

    Attributes:
        model: The planned model.
        rules: The rules it was compiled from.
        units: The planned ``fully_shard`` calls, in order.
        declarations: The model's keep-in-fp32 declarations that applied.
        claims: Per rule, in precedence order, what it claimed.
        world_size: Shards per unit (the shard dimension of the mesh). (Default: ``1``)
        reshard_after_forward: The ``fully_shard`` knob the counts assume and :meth:`apply`
            passes. (Default: ``None``, torch's: every unit but the root)
        hsdp: Units are sharded on a 2-D (replicate, shard) mesh. (Default: ``False``)
        replicated: 0-dim parameters, in no unit: replicated on every rank, computing in their
            storage dtype, gradients averaged after backward. (Default: ``()``)
        unit_choice: How the units were chosen and which selected modules were refused
            (``plan_model_for_training``). (Default: ``None``, units given by the caller)
    """

    model: nn.Module
    rules: PrecisionRules
    units: tuple[PlannedUnit, ...]
    declarations: tuple[_hf.Declaration, ...]
    claims: tuple[RuleClaims, ...]
    world_size: int = 1
    reshard_after_forward: bool | int | None = None
    hsdp: bool = False
    replicated: tuple[PlannedParam, ...] = ()
    unit_choice: UnitChoice | None = None

    @property
    def rule_claims(self) -> dict[str, list[str]]:
        """Display form of :attr:`claims`: rule label -> claimed FQNs."""
        from fsdp_precision._report import claim_labels

        return {label: list(c.fqns) for label, c in claim_labels(self.claims)}

    @property
    def knobs(self) -> _cost.Knobs:
        """The FSDP knobs the collective counts follow."""
        return _cost.Knobs(reshard_after_forward=self.reshard_after_forward, hsdp=self.hsdp)

    # ----------------------------------------------------------------- applying

    def apply(self, **fully_shard_kwargs: Any) -> nn.Module:
        """Make the planned ``fully_shard`` calls in order; return the model.

        Applies the patch first when a unit has a non-empty map. ``fully_shard_kwargs`` (mesh,
        offload_policy, ...) go to every call, with the plan's ``reshard_after_forward`` and
        the :attr:`replicated` parameters added to ``ignored_params``; those get their
        gradients averaged over the mesh. Before the first call, every call is checked as the
        installed release's ``fully_shard`` would check it (:meth:`check`), so a refused plan
        leaves the model untouched. Raises ``ValueError`` before any call when the kwargs
        contradict the knobs the plan was compiled with (``reshard_after_forward``, a 2-D mesh
        for ``hsdp``): its counts would be wrong.
        """
        from torch.distributed.fsdp import fully_shard

        from fsdp_precision._replicated import average_gradients

        kwargs = checked_kwargs(self, fully_shard_kwargs)
        scalars = [self.model.get_parameter(p.fqn) for p in self.replicated]
        if scalars:
            kwargs["ignored_params"] = set(kwargs.get("ignored_params") or ()) | set(scalars)
        if any(u.param_dtype_map for u in self.units):
            from fsdp_precision._patch import apply_param_dtype_map_patch

            apply_param_dtype_map_patch()
        self.check(ignored_params=kwargs.get("ignored_params"))
        for unit in self.units:
            target = unit.modules[0] if len(unit.modules) == 1 else list(unit.modules)
            fully_shard(target, mp_policy=unit.policy, **kwargs)
        average_gradients(scalars, kwargs.get("mesh"))
        # Mapped units had it done by their construction step; the others are plain calls.
        _hf.keep_output_recording(
            [m for u in self.units if not u.param_dtype_map for m in u.modules]
        )
        return self.model

    def check(self, *, ignored_params: Any = None) -> None:
        """Raise what any planned ``fully_shard`` call would refuse, before any is made.

        Per call: the map against the parameters it will manage (``ParamDtypeMapError``), the
        installed release's own refusals (2.11's non-floating parameters, ...), and
        parameters that are already sharded (``ValueError``: the model was wrapped before).
        """
        from fsdp_precision._preflight import check_plan

        check_plan(self, ignored_params or set())

    # ----------------------------------------------------------------- reporting

    def collectives(self, unit: PlannedUnit) -> _cost.Collectives:
        """Collectives of ``unit`` in one forward+backward under the plan's knobs."""
        return _cost.unit_collectives(unit, self.knobs)

    def totals(self) -> dict[str, Any]:
        """Units, collectives per step and bytes all-gathered per step, for this plan."""
        totals = _cost.totals(self.units, self.world_size, self.knobs)
        # Each trainable replicated (0-dim) parameter: one gradient all-reduce per backward.
        totals["all_reduces_per_step"] += sum(p.reduce is not None for p in self.replicated)
        return totals

    def alternatives(self) -> dict[str, dict[str, Any]]:
        """The same model under a uniform policy and under separate fp32 child units."""
        from fsdp_precision._report import alternatives

        return alternatives(self)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form of the plan (``json.dumps(plan.to_dict())``)."""
        from fsdp_precision._report import to_dict

        return to_dict(self)

    def to_json(self, **kwargs: Any) -> str:
        """``json.dumps(self.to_dict(), **kwargs)``."""
        import json

        return json.dumps(self.to_dict(), **kwargs)

    def explain(self, *, max_params: int = 12) -> str:
        """A human table: per unit, who claimed what, bytes per all-gather, collectives."""
        from fsdp_precision._report import explain

        return explain(self, max_params=max_params)


def checked_kwargs(plan: PrecisionPlan, fully_shard_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``fully_shard_kwargs`` with the plan's ``reshard_after_forward``, checked against the
    knobs the plan was compiled for (``ValueError`` naming the fix)."""
    kwargs = dict(fully_shard_kwargs)
    given = kwargs.setdefault("reshard_after_forward", plan.reshard_after_forward)
    planned = plan.reshard_after_forward
    if (type(given), given) != (type(planned), planned):
        raise ValueError(
            f"fully_shard_kwargs reshard_after_forward={given!r} contradicts the plan's "
            f"reshard_after_forward={planned!r}, which its collective counts assume; compile "
            f"the plan with reshard_after_forward={given!r} instead"
        )
    mesh = kwargs.get("mesh")
    two_d = mesh is not None and mesh.ndim == 2
    if two_d != plan.hsdp:
        raise ValueError(
            f"the plan was compiled with hsdp={plan.hsdp} but the mesh is "
            f"{'2-D' if two_d else '1-D'}; compile it with hsdp={two_d}"
        )
    return kwargs
