"""Exact storage upcasts: a user rule that keeps a parameter stored in a narrower dtype (a bf16
checkpoint's router, kept in fp32) plans its storage in the kept dtype.

Every value of the narrower dtype is one of the wider (``_base.dtypes.exact_upcast``), so nothing is
lost: the checkpoint never held more. The upcast is made when the plan is applied (or
``model_policy`` returns), after every check passed; the optimizer then updates fp32 master
weights. A model's own keep declaration stored narrower is refused instead
(:mod:`fsdp_precision._plan.claims`): a correct load would have kept it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

from fsdp_precision._plan.records import PlannedParam

__all__ = ["upcast_storage"]


def upcast_storage(model: nn.Module, params: Iterable[PlannedParam]) -> Callable[[], None]:
    """Upcast each planned parameter with ``upcast_from`` to its planned storage, in place
    (the ``Parameter`` objects stay, so do ties and optimizer references); return the undo,
    exact too (the values came from the narrower dtype)."""
    done: list[tuple[nn.Parameter, torch.dtype]] = []
    with torch.no_grad():
        for planned in params:
            param = model.get_parameter(planned.fqn)
            if planned.upcast_from is None or param.dtype != planned.upcast_from:
                continue
            param.data = param.data.to(planned.storage)
            done.append((param, planned.upcast_from))

    def undo() -> None:
        with torch.no_grad():
            for param, dtype in done:
                param.data = param.data.to(dtype)

    return undo
