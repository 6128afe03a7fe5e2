"""The plan's trace: one forward and backward of the model as its FSDP units will compute it,
before anything is wrapped.

Built on the :class:`~fsdp_precision._verify.reference.Reference` (each parameter in its planned
compute dtype, each unit's input and output casts, the boundary casts) with the hooks that name
a kept parameter in a dtype error (:mod:`fsdp_precision._policy.diagnose`). On a meta-device
model it costs no memory and no compute: the meta kernels check dtypes as the real ones do
("expected m1 and m2 to have the same dtype"). ``fsdp-precision plan`` runs it on the model's
``dummy_inputs`` and warns with the note when it fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fsdp_precision._advise.usage import call_forward, on_model_device
from fsdp_precision._plan.diagnose import install_plan_diagnosis
from fsdp_precision._plan.plan import PrecisionPlan
from fsdp_precision._policy.diagnose import is_dtype_mismatch, notes_of
from fsdp_precision._verify.inputs import InputWatch, RoundedInput
from fsdp_precision._verify.reference import Reference

__all__ = ["DtypeTrace", "RoundedInput", "trace_compute_dtypes"]


@dataclass(frozen=True)
class DtypeTrace:
    """What the trace saw.

    Attributes:
        ok: The forward and backward ran.
        error: The first line of the error, when it did not (``""`` otherwise).
        notes: The notes naming the kept parameter, the module and the fix (dtype errors).
        dtype_error: Whether the error was a dtype mismatch (others, such as a meta kernel
            missing, say nothing about the plan).
        rounded_inputs: The floating inputs the units' input casts round, each unit and
            argument once, in the order the forward met them (as far as it ran).
    """

    ok: bool
    error: str = ""
    notes: tuple[str, ...] = ()
    dtype_error: bool = False
    rounded_inputs: tuple[RoundedInput, ...] = ()

    def suggested_uncast(self) -> tuple[str, ...]:
        """Argument names worth ``uncast_inputs``: rounded, computed wider on purpose."""
        names = (r.argument for r in self.rounded_inputs if r.suggested and not r.uncast)
        return tuple(dict.fromkeys(n for n in names if n.isidentifier()))


def trace_compute_dtypes(plan: PrecisionPlan, inputs: Any) -> DtypeTrace:
    """Run ``plan.model`` as the plan's units will compute it, on ``inputs`` (keyword arguments
    for a mapping, positional for a tuple), forward and backward of the sum of its floating
    outputs; nothing of ``plan.model`` is modified. The inputs move to the model's device."""
    reference = Reference(plan)
    module = reference.module
    install_plan_diagnosis(module, plan, kept=lambda p: p.mapped)  # what construction names
    watch = InputWatch(module, plan)
    try:
        with torch.random.fork_rng(devices=[]):
            out = call_forward(module, on_model_device(module, inputs))
            leaves = [
                t
                for t in pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
            ]
            if leaves:
                sum(t.float().sum() for t in leaves).backward()  # type: ignore[union-attr]
    except Exception as exc:  # noqa: BLE001 - reported, the plan is only read
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return DtypeTrace(
            ok=False,
            error=f"{type(exc).__name__}: {first}"[:240],
            notes=tuple(notes_of(exc)),
            dtype_error=is_dtype_mismatch(exc),
            rounded_inputs=watch.seen(),
        )
    return DtypeTrace(ok=True, rounded_inputs=watch.seen())
