"""The layers the integration gives vLLM through its out-of-tree layer registry
(``PluggableLayer.register_oot``): vLLM builds these wherever a model builds the named layer.

- ``GateLinear`` (every MoE family's router): where the model being built keeps the gate's
  weight (:func:`.hold.building`), the gate is built with its parameters in the kept dtype and
  its logits in it: vLLM's own fallback tier then casts the input to the weight's dtype and runs
  the linear in it: the trainer's router (fp32 input, fp32 weight, fp32 logits).
- ``LogitsProcessor`` (every generative model): a guard only.

Both behave exactly as vLLM's own unless a model directory with the library's export record is
being built; where it is, but its architecture is not one the integration builds
(:data:`.archs.ARCHITECTURES`), they refuse by name rather than let vLLM round what was kept.

Imports vLLM: only :func:`.plugin.register` imports this module, inside vLLM's processes.
"""

from __future__ import annotations

import inspect
from typing import Any

from vllm.config import get_current_vllm_config_or_none
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor

from fsdp_precision._base.errors import EngineDtypeError
from fsdp_precision._engines.kept import kept_of_export
from fsdp_precision._engines.vllm.archs import ARCHITECTURES
from fsdp_precision._engines.vllm.hold import building

__all__ = ["KeptGateLinear", "KeptGuardLogitsProcessor", "refuse_uncovered"]

_GATE = inspect.signature(GateLinear.__init__)


def refuse_uncovered(what: str) -> None:
    """Raise where the model vLLM is building comes from a directory whose record keeps
    tensors, and no kept build is in progress (its architecture is not one the integration
    builds)."""
    config = get_current_vllm_config_or_none()
    model_config = getattr(config, "model_config", None)
    if model_config is None:
        return
    kept = kept_of_export(model_config.model)
    if kept is None or not kept.tensors:
        return
    architectures = list(getattr(model_config, "architectures", None) or ["?"])
    raise EngineDtypeError(
        f"'{model_config.model}' holds {kept.describe()}, and vLLM builds it as "
        f"{'/'.join(architectures)}, which fsdp-precision's vLLM integration does not build: "
        f"its {what} would compute in the bulk dtype. Architectures it builds: "
        f"{', '.join(sorted(ARCHITECTURES))}; for another, export without keeping tensors, "
        "or add the architecture (docs/after-training.md, 'vLLM')"
    )


class KeptGateLinear(GateLinear):  # type: ignore[misc]  # vLLM is untyped here
    """vLLM's ``GateLinear``, its parameters and logits in the kept dtype where the model
    being built keeps its weight."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = _GATE.bind(self, *args, **kwargs)
        prefix = bound.arguments.get("prefix", "")
        current = building()
        if current is None:
            refuse_uncovered(f"router {prefix!r}")
        else:
            dtype = current.dtype_of(f"{prefix}.weight")
            if dtype is not None:
                bound.arguments["params_dtype"] = dtype
                bound.arguments["out_dtype"] = dtype
        super().__init__(*bound.args[1:], **bound.kwargs)


class KeptGuardLogitsProcessor(LogitsProcessor):  # type: ignore[misc]  # vLLM is untyped here
    """vLLM's ``LogitsProcessor``; refuses a kept model of an architecture not built here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if building() is None:
            refuse_uncovered("kept tensors")
        super().__init__(*args, **kwargs)
