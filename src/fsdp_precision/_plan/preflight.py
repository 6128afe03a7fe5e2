"""Check every planned ``fully_shard`` call before the first one is made.

torch refuses some units only when it reaches them (a map key a call cannot take, 2.11's
non-floating parameters, an already sharded parameter, a module inside a unit already made;
0-dim parameters, which it refuses too, are in no planned unit); by then the inner units are
sharded and the model is half-wrapped. :func:`check_plan` runs the same checks for every call
first, on the parameters each call will manage.
"""

from __future__ import annotations

from collections.abc import Collection

import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_precision._base.errors import ParamDtypeMapError
from fsdp_precision._plan.data import PlanData
from fsdp_precision._policy.refusals import check_planned_call
from fsdp_precision._releases import SUPPORTED_RELEASES, torch_release

__all__ = ["check_plan"]


def check_plan(plan: PlanData, ignored_params: Collection[nn.Parameter]) -> None:
    """Raise what any planned call would refuse; touches nothing."""
    _check_order(plan)
    ignored = {id(p) for p in ignored_params}
    supported = torch_release() in SUPPORTED_RELEASES
    for unit in plan.units:
        params = []
        for planned in unit.params:
            param = plan.model.get_parameter(planned.fqn)
            if id(param) in ignored:
                continue
            if isinstance(param, DTensor):
                raise ValueError(
                    f"parameter {planned.fqn!r} is already sharded (a DTensor): the model was "
                    "wrapped before. Plan and wrap a model that fully_shard has not touched"
                )
            params.append(param)
        if supported:  # elsewhere there is no map to check (apply_param_dtype_map_patch raised)
            check_planned_call(unit.modules, params, unit.policy)


def _check_order(plan: PlanData) -> None:
    """A unit planned after a unit that contains it: ``fully_shard`` would fail on it inside
    torch ("Invariant encountered: value was None") with the outer unit already wrapped."""
    inside: dict[int, str] = {}  # id of every module under a unit planned so far -> that unit
    for unit in plan.units:
        for module in unit.modules:
            outer = inside.get(id(module))
            if outer is not None:
                raise ParamDtypeMapError(
                    f"unit {unit.name} is planned after unit {outer}, which contains it: "
                    "fully_shard cannot wrap a module inside a unit already made. Plan the "
                    "units innermost first (the root last)"
                )
        for module in unit.modules:
            for sub in module.modules():
                inside.setdefault(id(sub), unit.name)
