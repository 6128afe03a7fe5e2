"""The plan's records: planned parameters, planned ``fully_shard`` calls and the plan itself.

Every record is immutable: :mod:`fsdp_precision._plan.compile` builds them once, complete.
Reporting (``explain``, ``to_dict``) lives in :mod:`fsdp_precision._plan.report`, the collective
counts in :mod:`fsdp_precision._plan.cost`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._plan.quantized import wire_itemsize
from fsdp_precision._policy.casts import ModuleCast
from fsdp_precision._policy.policy import ParamDtypeMixedPrecisionPolicy
from fsdp_precision._rules.rules import AnyRule, rule_label

__all__ = ["PlannedParam", "PlannedUnit", "RuleClaims", "gather_bytes", "kept_reasons"]


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
        upcast_from: The narrower dtype the parameter is stored in now, when a user rule keeps
            it wider: its storage is upcast to :attr:`storage` (exactly: every value of the
            narrower dtype is one of the wider) before the first ``fully_shard`` call, the
            master weights then hold it in the kept dtype. (Default: ``None``)
        gathered_as: What the parameter all-gathers as when its class does that itself
            (``fsdp_pre_all_gather``): ``"float8"`` for torchao's float8 weights (1 byte per
            element), else the class name (bytes estimated at :attr:`compute`). (Default:
            ``None``: :attr:`compute`)
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
    upcast_from: torch.dtype | None = None
    gathered_as: str | None = None

    @property
    def claimed(self) -> bool:
        """Whether a rule claimed it (see :attr:`mapped` for whether that changes its dtype)."""
        return self.claimed_by is not None

    @property
    def kept(self) -> bool:
        """Deprecated spelling of :attr:`claimed`."""
        warnings.warn(
            "PlannedParam.kept is deprecated: use PlannedParam.claimed (a rule claimed it) or "
            "PlannedParam.mapped (its unit's map has an entry for it)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.claimed

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
        separate_unit: A module holding mapped parameters, made its own unit by the
            separate-units layout. (Default: ``False``)
        module_casts: Root-relative module FQN -> the boundary cast of each module the call
            keeps whole (:mod:`fsdp_precision._plan.casts`); the policy holds them relative to
            the call's module (by module for a grouped call). (Default: none)
        uncast_inputs: Forward argument names the call's input cast leaves in the dtype they
            arrive in (``PrecisionRules.uncast_inputs`` that its modules take). In a mapped
            policy they are the policy's own; a plain policy (the separate-units layout) casts
            no input, and :meth:`PrecisionPlan.apply` installs the cast that leaves them out.
            (Default: none)
    """

    name: str
    modules: tuple[nn.Module, ...]
    params: tuple[PlannedParam, ...]
    policy: MixedPrecisionPolicy
    is_root: bool
    separate_unit: bool = False
    module_casts: Mapping[str, ModuleCast] = field(default_factory=dict)
    uncast_inputs: frozenset[str] = frozenset()

    @property
    def split_child(self) -> bool:
        """Deprecated spelling of :attr:`separate_unit`."""
        warnings.warn(
            "PlannedUnit.split_child is deprecated: use PlannedUnit.separate_unit",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.separate_unit

    @property
    def param_dtype_map(self) -> dict[str, torch.dtype]:
        """The exact map of the call (empty for a plain ``MixedPrecisionPolicy``)."""
        policy = self.policy
        if isinstance(policy, ParamDtypeMixedPrecisionPolicy):
            return dict(policy.param_dtype_map or {})
        return {}

    def gather_bytes(self, world_size: int = 1) -> dict[str, int]:
        """Bytes of one all-gather of this unit, by compute dtype (with dim-0 padding)."""
        return gather_bytes(self.params, world_size)

    @property
    def trainable(self) -> bool:
        """Whether any parameter has a gradient to reduce."""
        return any(p.reduce is not None for p in self.params)


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


def kept_reasons(
    params: Iterable[PlannedParam], mapped: Mapping[str, torch.dtype]
) -> dict[str, str]:
    """Why each mapped parameter is kept, by every name (aliases too): the label of the rule or
    declaration that claimed it, or its storage dtype where a unit mixing storage dtypes maps it."""
    reasons: dict[str, str] = {}
    for p in params:
        if p.fqn not in mapped:
            continue
        why = rule_label(p.claimed_by) if p.claimed_by is not None else f"stored in {p.storage}"
        reasons.update(dict.fromkeys((p.fqn, *p.aliases), why))
    return reasons


def gather_bytes(params: Iterable[PlannedParam], world_size: int) -> dict[str, int]:
    """Bytes of one all-gather of ``params``, by compute dtype, or by the format a tensor
    subclass gathers itself in (``"float8"``), with dim-0 padding."""
    out: dict[str, int] = {}
    for p in params:
        key = p.gathered_as or dtype_name(p.compute)
        size = (wire_itemsize(p.gathered_as) if p.gathered_as else None) or p.compute.itemsize
        out[key] = out.get(key, 0) + p.padded_numel(world_size) * size
    return out
