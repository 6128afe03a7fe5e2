"""vLLM's general plugin: how vLLM learns, in every process it starts, to hold what training kept.

vLLM runs the ``vllm.general_plugins`` entry points in each of its processes before any model is
built (``pyproject.toml`` names :func:`register`); a user starts vLLM as always. ``register``
adds two layers to vLLM's out-of-tree layer registry (:mod:`.layers`) and registers the
integration's model classes over vLLM's for the architectures it builds (:mod:`.models`). Both
behave as vLLM's own unless the model directory holds the library's export record: the plugin
does nothing without its trigger, and says in one log line what it changed where it acts.
``VLLM_PLUGINS`` (vLLM's own setting) turns it off.
"""

from __future__ import annotations

import logging

from fsdp_precision._engines.vllm.archs import ARCHITECTURES

__all__ = ["register"]

logger = logging.getLogger(__name__)

_MODELS = "fsdp_precision._engines.vllm.models"


def register() -> None:
    """Register the integration with the vLLM of this process (idempotent)."""
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot  # lazy: the engine
    from vllm.model_executor.models.registry import ModelRegistry  # lazy: the engine's registry

    from fsdp_precision._engines.vllm import layers, models  # lazy: they import vLLM

    for name, cls in (
        ("GateLinear", layers.KeptGateLinear),
        ("LogitsProcessor", layers.KeptGuardLogitsProcessor),
    ):
        current = op_registry_oot.get(name)
        if current is cls:
            continue
        if current is not None:
            logger.warning(
                "fsdp-precision: another vLLM plugin replaced %s (%s); a kept router is then "
                "built in the bulk dtype and refused by name",
                name,
                current,
            )
            continue
        PluggableLayer.register_oot(name=name)(cls)
    supported = set(ModelRegistry.get_supported_archs())
    for architecture in ARCHITECTURES:
        entry = ModelRegistry.models.get(architecture)
        if architecture not in supported or getattr(entry, "module_name", "") == _MODELS:
            continue
        models.ORIGINALS[architecture] = entry
        ModelRegistry.register_model(architecture, f"{_MODELS}:{architecture}")
