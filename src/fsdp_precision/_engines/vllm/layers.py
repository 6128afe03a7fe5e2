"""The layers the integration gives vLLM through its out-of-tree layer registry
(``PluggableLayer.register_oot``): vLLM builds these wherever a model builds the named layer.

- ``GateLinear`` (every MoE family's router): where the model being built keeps the gate's
  weight (:func:`.hold.building`), the gate is built with its parameters in the kept dtype and
  its logits in it: vLLM's own fallback tier then casts the input to the weight's dtype and runs
  the linear in it: the trainer's router (fp32 input, fp32 weight, fp32 logits).
- ``VocabParallelEmbedding`` (every text model, generative or pooling: reward, classifier and
  embedding models build it too): a guard only.

Both behave exactly as vLLM's own unless the engine is told that tensors are kept (an export's
record, or a declaration: :mod:`fsdp_precision._engines.declaration`); where it is, but the
architecture is not one the integration builds (:data:`.archs.ARCHITECTURES`), or the plugin
could not register all it needs (:data:`DEGRADED`), they refuse by name rather than let vLLM
round what was kept.

Imports vLLM: only :func:`.plugin.register` imports this module, inside vLLM's processes.
"""

from __future__ import annotations

import inspect
from typing import Any

from vllm.config import get_current_vllm_config_or_none
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

from fsdp_precision._base.errors import EngineDtypeError
from fsdp_precision._engines.vllm.archs import ARCHITECTURES
from fsdp_precision._engines.vllm.hold import building, kept_of_config

__all__ = ["DEGRADED", "REPLACED", "KeptGateLinear", "KeptGuardEmbedding", "refuse_uncovered"]

#: Why the plugin could not register all it needs in this process (:mod:`.plugin`): where any
#: reason is listed, a model that keeps tensors is refused by name; stock models are untouched.
DEGRADED: list[str] = []

_GATE = inspect.signature(GateLinear.__init__)


def refuse_uncovered(what: str) -> None:
    """Raise where the engine is told the model it builds keeps tensors, and no kept build is
    in progress (its architecture is not one the integration builds, or the plugin could not
    register what holds them)."""
    config = get_current_vllm_config_or_none()
    model_config = getattr(config, "model_config", None)
    if model_config is None:
        return
    kept = kept_of_config(config)
    if kept is None or not kept.tensors:
        return
    architectures = "/".join(getattr(model_config, "architectures", None) or ["?"])
    if DEGRADED:
        raise EngineDtypeError(
            f"'{model_config.model}' keeps {kept.describe()}, and fsdp-precision's vLLM plugin "
            f"could not register what holds them in this vLLM ({'; '.join(DEGRADED)}): its "
            f"{what} would compute in the bulk dtype. Use a vLLM release the integration was "
            "run against (fsdp_precision.integrations.vllm.TESTED_VLLM), or serve the model "
            "without keeping tensors"
        )
    raise EngineDtypeError(
        f"'{model_config.model}' keeps {kept.describe()}, and vLLM builds it as "
        f"{architectures}, which fsdp-precision's vLLM integration does not build: its {what} "
        f"would compute in the bulk dtype. Architectures it builds: "
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


class KeptGuardEmbedding(VocabParallelEmbedding):  # type: ignore[misc]  # vLLM is untyped
    """vLLM's ``VocabParallelEmbedding``; refuses a kept model of an architecture not built
    here (its subclass ``ParallelLMHead`` is vLLM's own, untouched)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if building() is None:
            refuse_uncovered("kept tensors")
        super().__init__(*args, **kwargs)


#: vLLM's layer name -> the integration's class, and the constructor arguments the
#: integration sets (the registration's self-test finds them in vLLM's signature).
REPLACED: dict[str, tuple[type[Any], tuple[str, ...]]] = {
    "GateLinear": (KeptGateLinear, ("prefix", "params_dtype", "out_dtype")),
    "VocabParallelEmbedding": (KeptGuardEmbedding, ()),
}
