"""A model-scoped policy is never silently dropped.

Frameworks decide for themselves whether to call ``fully_shard``: accelerate on one process
without a launcher runs as ``DistributedType.NO`` and prepares the model as it is, and on a
CPU-only machine it wraps it in DDP (NeMo Automodel #3589 met the same skip at world size 1). The
policy that :func:`fsdp_precision.model_policy` built then applies nowhere: under autocast the
kept router computes in bf16 and nothing says so; without it, its fp32 weight meets bf16
activations ("expected m1 and m2 to have the same dtype"). The guard stops the first training
forward (gradients enabled) of a model that no ``fully_shard`` call reached, with the fix; a
model that was sharded (any of its modules is an ``FSDPModule``) drops the guard at its first
forward. Forwards without gradients (evaluation, tracing) pass.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle

from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._base.errors import PolicyNotAppliedError

__all__ = ["guard_unapplied"]

_ATTR = "_fsdp_precision_unapplied_guard"


class _Guard:
    """The forward pre-hook on the model a policy was built for (one per model).

    Pickles as a guard that does nothing (a pickled model carries no live policy)."""

    def __init__(self, model_name: str, kept: dict[str, torch.dtype]) -> None:
        self.model_name = model_name
        self.kept = kept
        self.handle: RemovableHandle | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "kept": {}, "handle": None}

    @torch.compiler.disable  # type: ignore[untyped-decorator,unused-ignore]
    def __call__(self, module: nn.Module, args: Any) -> None:
        if self.handle is None:
            return
        if any(isinstance(m, FSDPModule) for m in module.modules()):
            self.handle.remove()  # sharded: the calls' own checks took over
            self.handle = None
            return
        if torch.is_grad_enabled():
            raise PolicyNotAppliedError(self._message())

    def _message(self) -> str:
        shown = ", ".join(f"{fqn!r} in {dtype_name(d)}" for fqn, d in list(self.kept.items())[:2])
        more = f" and {len(self.kept) - 2} more" if len(self.kept) > 2 else ""
        kept = f" ({shown}{more})" if shown else ""
        return (
            f"a model_policy was built for this {self.model_name}, and it runs a training forward "
            "that no fully_shard call prepared: the policy applies nowhere, so its kept "
            f"dtypes{kept} do not hold (under autocast they compute in bf16; without it the "
            "kept weights meet bf16 activations). accelerate skips FSDP on one process "
            "without a launcher (DistributedType.NO): launch the script with `torchrun "
            "--nproc_per_node N` or `accelerate launch` (N=1 is fine). On a CPU-only machine it "
            "uses DDP instead: call fsdp_precision.integrations.accelerate_fsdp2_on_cpu (or "
            "cpu_fsdp2_trainer) before prepare. With your own fully_shard calls, pass them the "
            "policy"
        )


def guard_unapplied(model: nn.Module, model_name: str, kept: dict[str, torch.dtype]) -> None:
    """Stop ``model``'s first training forward when no ``fully_shard`` call reached it. A later
    policy for the same model replaces the earlier one's guard."""
    guard = getattr(model, _ATTR, None)
    if isinstance(guard, _Guard) and guard.handle is not None:
        guard.kept = kept
        return
    guard = _Guard(model_name, kept)
    guard.handle = model.register_forward_pre_hook(guard)
    setattr(model, _ATTR, guard)
