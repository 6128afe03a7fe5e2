"""SGLang holds what training kept where it has a setting for it, and is refused by name where it
has none; its distributed weight updates carry the kept dtypes.

SGLang does not run on CPU-only machines (docs/after-training.md, "SGLang"), so this module does
not start it or import it: it computes, from what the library writes (an export's record, a
weight stream's metadata) and the model's architecture, the launch settings to pass and the
update calls to make, from what was read in SGLang's source (:data:`READ_SGLANG`).

>>> settings = sglang_settings("out/export")                           # doctest: +SKIP
>>> engine = sgl.Engine(model_path="out/export", **settings.engine_kwargs())  # doctest: +SKIP

A kept tensor SGLang holds in the model dtype whatever its settings (Qwen3-MoE, Qwen2-MoE and
Mixtral gates) raises :class:`~fsdp_precision.EngineDtypeError` naming it, before anything
starts. Updates: :func:`distributed_updates` (the arguments of
``update_weights_from_distributed``) and :func:`update_payloads` (what the trainer broadcasts).
"""

from __future__ import annotations

from fsdp_precision._engines.sglang import (
    ARCHITECTURES,
    READ_SGLANG,
    SGLangSettings,
    sglang_settings,
)
from fsdp_precision._engines.sglang_update import (
    DistributedUpdate,
    FlatTensor,
    distributed_updates,
    update_payloads,
)

__all__ = [
    "ARCHITECTURES",
    "READ_SGLANG",
    "DistributedUpdate",
    "FlatTensor",
    "SGLangSettings",
    "distributed_updates",
    "sglang_settings",
    "update_payloads",
]
