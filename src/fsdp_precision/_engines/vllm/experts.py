"""Expert layers that compute right after a weight update.

vLLM 0.32's ``UnquantizedFusedMoEMethod`` runs its expert kernel's own post-load processing
(``fused_experts.process_weights_after_loading``) on the first load only: on an update
(``reload_weights``, in place) it copies the new weights in the checkpoint's layout and skips it.
On the CPU build that processing is the prepack into the kernel's grouped-GEMM layout, so after
any update the experts compute on unpacked weights (argmax differs on 32 of 752 positions of a
tiny Qwen3-MoE reloaded with its own weights; docs/known-issues.md).

:func:`repair_expert_updates` wraps each MoE layer's quant method (the instance's
``process_weights_after_loading``, which vLLM's update path calls on the reloaded layer before
copying it into the running one): it watches whether the kernel's own processing ran, and where
an update skipped it, runs it, for the kernels in :data:`.archs.REPACKED_EXPERTS` (where the
result is checked bitwise against a fresh load); for another kernel it says so in the log. The
first load is vLLM's path unchanged. Pure attribute access on vLLM's objects; no import of vLLM.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.nn as nn

from fsdp_precision._engines.vllm.archs import REPACKED_EXPERTS

__all__ = ["repair_expert_updates"]

logger = logging.getLogger(__name__)

_MARK = "_fsdp_precision_repaired"
#: The base class whose ``process_weights_after_loading`` does nothing (vLLM 0.32).
_NO_OP_BASE = "FusedMoEExperts"
_warned: set[str] = set()


def repair_expert_updates(model: nn.Module) -> int:
    """Wrap the quant method of each MoE layer of ``model`` (idempotent); return how many."""
    count = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(method, "moe_kernel") or getattr(method, _MARK, False):
            continue
        method.process_weights_after_loading = _Repaired(method)
        setattr(method, _MARK, True)
        count += 1
    return count


class _Repaired:
    """A quant method's ``process_weights_after_loading`` that runs the expert kernel's own
    processing where an update skipped it."""

    def __init__(self, method: Any) -> None:
        self.method = method
        self.original = method.process_weights_after_loading

    def __call__(self, layer: nn.Module) -> None:
        kernel = getattr(self.method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None:  # the first load: vLLM's path as it is
            self.original(layer)
            return
        ran: list[bool] = []
        own = experts.process_weights_after_loading

        def watched(target: nn.Module) -> None:
            ran.append(True)
            own(target)

        experts.process_weights_after_loading = watched
        try:
            self.original(layer)
        finally:
            del experts.process_weights_after_loading
        if ran or _defined_by(experts) == _NO_OP_BASE:
            return
        kind = type(experts).__name__
        if kind in REPACKED_EXPERTS:
            own(layer)
            logger.debug("fsdp-precision: re-ran %s's post-load processing after an update", kind)
        elif kind not in _warned:
            _warned.add(kind)
            logger.warning(
                "fsdp-precision: vLLM updated an MoE layer without running %s's post-load "
                "processing; it is not known whether that kernel needs it (checked: %s)",
                kind,
                ", ".join(sorted(REPACKED_EXPERTS)),
            )


def _defined_by(experts: Any) -> str:
    """The name of the class that defines the kernel's ``process_weights_after_loading``."""
    for cls in type(experts).__mro__:
        if "process_weights_after_loading" in vars(cls):
            return cls.__name__
    return ""
