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
"""

from __future__ import annotations

from fsdp_precision._engines.vllm.archs import ARCHITECTURES, TESTED_VLLM
from fsdp_precision._engines.vllm.experts import repair_expert_updates
from fsdp_precision._engines.vllm.plugin import register
from fsdp_precision._engines.vllm.update import WeightReceiver, update_weights

__all__ = [
    "ARCHITECTURES",
    "TESTED_VLLM",
    "WeightReceiver",
    "register",
    "repair_expert_updates",
    "update_weights",
]
