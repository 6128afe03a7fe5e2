"""The notes a dtype error gets at the first forward, for a plan's units.

The construction step installs them for every unit with a map (``_patch.construct``). A plan
whose units carry no map, the separate-units layout, gets the same hooks from here once its
calls are made, so that the same rules give the same answer in every layout: the module that
holds kept parameters, or the call after whose kept modules the error came, named with the fix
(:mod:`fsdp_precision._policy.diagnose`). The traced first forward of ``fsdp-precision plan``
installs them on its reference too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from fsdp_precision._plan.data import PlanData
from fsdp_precision._plan.records import PlannedParam
from fsdp_precision._policy.casts import installed_cast
from fsdp_precision._policy.diagnose import install_diagnosis, kept_modules

__all__ = ["computes_kept", "install_plan_diagnosis"]


def computes_kept(plan: PlanData) -> Callable[[PlannedParam], bool]:
    """Whether a planned parameter computes in another dtype than the rules' ``param_dtype``
    gives it (a parameter kept wider, or stored so in a unit that keeps it): what a separate
    unit holds, where no map says it."""
    default = plan.rules.param_dtype

    def kept(p: PlannedParam) -> bool:
        floating = p.storage.is_floating_point
        return floating and p.compute != ((default if floating else None) or p.storage)

    return kept


def install_plan_diagnosis(
    target: nn.Module, plan: PlanData, kept: Callable[[PlannedParam], bool]
) -> None:
    """Install the naming hooks of each planned call on ``target`` (``plan.model``, or a module
    of its structure), innermost first, as the construction step would: each call's modules,
    and under them the modules holding the parameters ``kept`` selects that no earlier call
    took. A separate-units layout's own units of kept modules are not calls here: their
    modules are watched from the call that contains them, as in the in-unit layout."""
    names = {id(m): n for n, m in plan.model.named_modules(remove_duplicate=False)}
    planned = plan.params_by_fqn
    for unit in plan.units:
        if unit.separate_unit:
            continue
        roots = [names[id(m)] for m in unit.modules]
        members = [target.get_submodule(n) for n in roots]
        by_slot: dict[tuple[int, str], torch.dtype] = {}
        for root, member in zip(roots, members, strict=True):
            for prefix, sub in member.named_modules(remove_duplicate=False):
                for attr in sub._parameters:
                    p = planned.get(".".join(part for part in (root, prefix, attr) if part))
                    if p is not None and kept(p):
                        by_slot[(id(sub), attr)] = p.compute
        casts = [(m, c) for member in members for m in member.modules() if (c := installed_cast(m))]
        if by_slot or casts:
            install_diagnosis(members, kept_modules(members, by_slot, casts))
