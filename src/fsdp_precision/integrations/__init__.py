"""Hand a :func:`~fsdp_precision.model_policy` to frameworks that call ``fully_shard`` themselves.

accelerate's FSDP2 plugin passes the object given as ``mixed_precision_policy`` unchanged to
every ``fully_shard`` call it makes (the decoder layers, the input embedding, a grouped
``[final norm, lm_head]`` call, the root), so a model-scoped policy needs no adapter there:

>>> plugin = FullyShardedDataParallelPlugin(  # doctest: +SKIP
...     fsdp_version=2, mixed_precision_policy=model_policy(model, rules),
...     auto_wrap_policy="transformer_based_wrap")

What this module adds is the three seams that are not obvious (docs/integrations.md):

* :func:`trainer_fsdp_policy`: the HF Trainer (and TRL's trainers, which build on it) drops
  unknown ``fsdp_config`` keys; the policy goes into ``TrainingArguments.fsdp_plugin_args``,
  which the Trainer splats into its plugin.
* :func:`transformers_native_fsdp`: transformers' own FSDP2 path (``from_pretrained(...,
  distributed_config=transformers.DistributedConfig(fsdp_size=N))``) hard-codes its policy; inside
  this context manager it uses a model-scoped one (guarded by source hashes, like the patch).
* :func:`accelerate_fsdp2_on_cpu`: accelerate enables FSDP only for accelerator device types and
  silently falls back to DDP on a CPU-only machine; this turns the FSDP2 plugin back on, for
  CPU (gloo) tests and development boxes.
* :func:`last_complete_checkpoint`: the Trainer's save is not atomic, and
  ``resume_from_checkpoint=True`` picks the newest ``checkpoint-N`` by name, half-written or not;
  this returns the newest one the Trainer finished (its ``trainer_state.json`` is written last).

The other half of an RL loop, the inference engine: :func:`declare_kept` writes what the
trainer keeps for an engine started from the base checkpoint (``FSDP_PRECISION_KEPT=file``, or
vLLM's ``additional_config={"fsdp_precision": file}``); :func:`send_weights` and
:func:`receive_weights` carry a weight stream to an engine in another process (metadata first,
then the tensors in their own dtypes, over ``torch.distributed``; :func:`weight_group` makes a
group of their own), and :mod:`fsdp_precision.integrations.vllm` keeps the kept tensors kept
inside vLLM.

Only public attributes of accelerate's state are set; the package is imported lazily.
"""

from __future__ import annotations

from fsdp_precision._engines.declaration import KEPT_ENV, declare_kept
from fsdp_precision._engines.transfer import (
    ReceivedWeights,
    receive_weights,
    send_weights,
    weight_group,
)
from fsdp_precision._train.integrations import (
    accelerate_fsdp2_on_cpu,
    cpu_fsdp2_trainer,
    last_complete_checkpoint,
    trainer_fsdp_policy,
)
from fsdp_precision._train.transformers_native import transformers_native_fsdp

__all__ = [
    "KEPT_ENV",
    "ReceivedWeights",
    "accelerate_fsdp2_on_cpu",
    "cpu_fsdp2_trainer",
    "declare_kept",
    "last_complete_checkpoint",
    "receive_weights",
    "send_weights",
    "trainer_fsdp_policy",
    "transformers_native_fsdp",
    "weight_group",
]
