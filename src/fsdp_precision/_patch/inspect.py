"""What a wrapped model's FSDP2 units hold: each managed parameter's unit, compute dtype and the
policy its ``fully_shard`` call was given. Read-only; for what happens around the step (export,
the hand-off to inference engines), never on the hot paths.

Reads torch's FSDP state (``FSDPModule._get_fsdp_state()``, its parameter groups, each
``FSDPParam``'s module and attribute) and the tags the patch's construction left on mapped
calls' parameters (:mod:`fsdp_precision._patch.tags`); importing it touches no private module.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from fsdp_precision._patch.tags import tagged_call

__all__ = ["ManagedParam", "managed_params"]


@dataclass(frozen=True)
class ManagedParam:
    """One parameter an FSDP2 unit manages, as the unit computes it.

    Attributes:
        unit: The root-relative FQN of the first module its ``fully_shard`` call was given
            (``""``: the root).
        compute: The dtype the unit all-gathers and computes it in.
        mapped: A ``param_dtype_map`` entry gave :attr:`compute` (rather than ``param_dtype``).
        policy: The policy the call was given (a :class:`ModelScopedPolicy` for ``model_policy``).
    """

    unit: str
    compute: torch.dtype
    mapped: bool
    policy: MixedPrecisionPolicy


def _groups(state: Any) -> list[Any]:
    # torch 2.12 builds a list of groups per call (per-parameter meshes); 2.11 one group.
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def _states(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """``(name of the call's first module, state)`` of every ``fully_shard`` call in ``model``."""
    seen: set[int] = set()
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        if id(state) not in seen:  # a grouped call's members share one state
            seen.add(id(state))
            yield name, state


def managed_params(model: nn.Module) -> dict[tuple[int, str], ManagedParam]:
    """Every parameter an FSDP2 unit in ``model`` manages, by slot ``(id(owner module), name)``.

    A parameter no unit manages (the model is not wrapped, or it is in ``ignored_params``) has no
    entry: it computes in its storage dtype.
    """
    found: dict[tuple[int, str], ManagedParam] = {}
    for unit, state in _states(model):
        for group in _groups(state):
            for fsdp_param in group.fsdp_params:
                info = fsdp_param._module_info
                given = tagged_call(fsdp_param)
                policy = group.mp_policy if given is None else given[0]
                resolved = given[1] if given is not None else None
                mapped = resolved is not None
                storage = fsdp_param.sharded_param.dtype
                compute: torch.dtype
                if resolved is not None:
                    compute = resolved
                elif policy.param_dtype is None or not storage.is_floating_point:
                    compute = storage
                else:
                    compute = policy.param_dtype
                slot = (id(info.module), info.param_name)
                found[slot] = ManagedParam(unit, compute, mapped, policy)
                for shared, name in zip(info.shared_modules, info.shared_param_names, strict=True):
                    found[(id(shared), name)] = found[slot]  # every alias of a tied one
    return found
