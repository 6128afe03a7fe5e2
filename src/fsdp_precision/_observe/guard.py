"""A runtime guard: name the module used outside its FSDP unit instead of torch's DTensor error.

Inside a unit's forward FSDP registers the gathered (unsharded) parameters, so model code never
sees a sharded one. A sharded parameter (a ``DTensor``) reaching an op, or having its ``.dtype``
read, from model code therefore means a module ran, or a parameter was read, while its unit was
not gathered: torch then fails with "mixed torch.Tensor and DTensor" or computes with the
storage dtype. :func:`unit_guard` raises :class:`~fsdp_precision.UnitUsageError` at that first
use, naming the parameter, the module whose forward was running and the parameter's unit.
FSDP's own code (and this library's) handles sharded parameters legitimately and is not checked.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_precision._base.errors import UnitUsageError
from fsdp_precision._base.watch import ParamWatch, RunningModules, attribute_read
from fsdp_precision._plan.plan import PrecisionPlan

__all__ = ["unit_guard"]

#: Code that handles sharded parameters by design.
_TRUSTED = ("torch.distributed", "torch.utils", "torch.autograd", "fsdp_precision")
#: Code between the caller and the op (functional wrappers, nn layers, ``Module.__call__``):
#: skipped to find who really used the parameter.
_PLUMBING = (
    "torch.overrides",
    "torch.nn.functional",
    "torch.functional",
    "torch._tensor",
    "torch.nn.modules",
)


def _caller() -> str:
    # 0: here, 1: _Guard.touched, 2: ParamWatch.__torch_function__, 3: who called the function
    frame = sys._getframe(3)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_PLUMBING):
        frame = frame.f_back  # type: ignore[assignment]
    return "" if frame is None else str(frame.f_globals.get("__name__", ""))


class _Guard(ParamWatch):
    def __init__(self, sharded: dict[int, tuple[str, str]], running: RunningModules) -> None:
        super().__init__(sharded)
        self.sharded = sharded
        self.running = running

    def touched(self, func: Callable[..., Any], tensor: torch.Tensor) -> None:
        if isinstance(tensor, DTensor) and not _caller().startswith(_TRUSTED):
            self._raise(func, tensor)

    def _raise(self, func: Callable[..., Any], leaf: DTensor) -> None:
        fqn, unit = self.sharded[id(leaf)]
        attribute = attribute_read(func)
        name = f"a read of .{attribute}" if attribute else getattr(func, "__name__", str(func))
        where = self.running.innermost
        raise UnitUsageError(
            f"parameter {fqn!r} was used ({name}) in the forward of {where}, outside its FSDP "
            f"unit [{unit}], which was not gathered: torch would fail with 'mixed torch.Tensor "
            f"and DTensor' or compute with the storage dtype. Make [{unit}] not a unit (or "
            f"make the module owning {fqn!r} its own unit): wrap_model_for_training and "
            "plan_model_for_training choose units torch can run"
        )


@contextmanager
def unit_guard(plan: PrecisionPlan) -> Iterator[None]:
    """While active, a sharded parameter of ``plan.model`` used by model code raises
    :class:`~fsdp_precision.UnitUsageError` naming it, the running module and its unit.

    Enter it after :meth:`PrecisionPlan.apply`, around forwards (``fsdp-precision verify`` does).
    """
    model: nn.Module = plan.model
    sharded = {
        id(p): (fqn, plan.unit_names.get(fqn, "?"))
        for fqn, p in model.named_parameters()
        if isinstance(p, DTensor)
    }
    with RunningModules(model) as running, _Guard(sharded, running):
        yield
