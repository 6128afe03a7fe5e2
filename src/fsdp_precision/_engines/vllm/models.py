"""The integration's model classes: vLLM's own, subclassed, registered in vLLM's model registry
under the same architecture names (:func:`.plugin.register`), resolved lazily by vLLM from
``fsdp_precision._engines.vllm.models:<Architecture>``.

Where the engine is told nothing is kept (no export record beside the model, no declaration:
:func:`.hold.kept_of_config`) the subclass is vLLM's class: ``__init__`` and ``load_weights`` go
straight to it. Where it is, the model is built inside
:func:`.hold.build` (so its routers are built in the kept dtype), then :class:`.hold.Held`
converts or refuses the rest before any weight is read, every load is read back, and updates
repair the expert layouts vLLM's update path leaves unprocessed (:mod:`.experts`).

Imports vLLM: resolved only inside vLLM's processes.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch.nn as nn
import vllm
from vllm.model_executor.model_loader.reload.layerwise import (
    finalize_layerwise_reload,
    get_layerwise_info,
)
from vllm.model_executor.models.registry import ModelRegistry
from vllm.model_executor.models.utils import is_pp_missing_parameter

from fsdp_precision._base.errors import EngineDtypeError
from fsdp_precision._engines.kept import EngineKept
from fsdp_precision._engines.vllm.archs import ARCHITECTURES, UNTESTED_ENV, tested
from fsdp_precision._engines.vllm.experts import repair_expert_updates
from fsdp_precision._engines.vllm.hold import Held, build, fused_of, kept_of_config, renamer_of
from fsdp_precision._engines.vllm.layers import DEGRADED, refuse_uncovered

__all__ = ["CACHE_KEY", "ORIGINALS", "model_class"]

logger = logging.getLogger(__name__)

#: vLLM's own registry entries of the architectures the plugin registered over, kept by
#: :func:`.plugin.register`; a process where it did not run (vLLM's model inspection
#: subprocess) reads vLLM's registry, which then holds them.
ORIGINALS: dict[str, Any] = {}


def _original(architecture: str) -> type[nn.Module]:
    entry = ORIGINALS.get(architecture) or ModelRegistry.models[architecture]
    cls = entry.load_model_cls()
    assert not getattr(cls, "_fsdp_precision_model", False), architecture  # not our own
    return cls  # type: ignore[no-any-return]


def _refuse_if_untested(kept: EngineKept, model: str) -> None:
    """A kept model on a vLLM outside the releases the integration was run against is refused
    by name (``FSDP_PRECISION_ALLOW_UNTESTED_VLLM=1`` builds it anyway: every kept tensor is
    still read back after each load); stock models are never affected."""
    version = str(vllm.__version__)
    if tested(version):
        return
    if os.environ.get(UNTESTED_ENV) == "1":
        logger.warning(
            "fsdp-precision: vLLM %s is outside the releases its integration was run against; "
            "building %s anyway (%s=1): every kept tensor is read back after each load",
            version, model, UNTESTED_ENV,
        )  # fmt: skip
        return
    raise EngineDtypeError(
        f"'{model}' keeps {kept.describe()}, and vLLM {version} is outside the releases "
        "fsdp-precision's vLLM integration was run against (fsdp_precision.integrations.vllm."
        f"TESTED_VLLM): install one of those, or set {UNTESTED_ENV}=1 to build it anyway (every "
        "kept tensor is still read back after each load)"
    )


#: The key of vLLM's ``additional_config`` that keys its compile cache by what is kept.
CACHE_KEY = "fsdp_precision_kept"


def _key_compile_cache(vllm_config: Any, kept: EngineKept) -> None:
    """Put what is kept into vLLM's ``additional_config`` before the model's compiled parts are
    built: vLLM hashes that dict into its compile-cache key, so a graph compiled for one plan
    (an fp32 router) is never reused for another (an export or declaration changed in place)."""
    additional = getattr(vllm_config, "additional_config", None)
    if isinstance(additional, dict):
        additional[CACHE_KEY] = kept.digest()


def _finish_reload(model: nn.Module, model_config: Any) -> None:
    """Where ``load_weights`` refuses inside vLLM's in-place reload (``reload_weights``), the
    error skips vLLM's own finishing step and would leave its layers on the meta device: run it
    first. Layers that received nothing (the refused tensors') get their previous values back,
    as vLLM does for a tensor an update leaves out."""
    if not any(get_layerwise_info(m).can_load() for m in model.modules()):
        return  # not inside a layerwise reload: the first load, or a direct call
    finalize_layerwise_reload(model, model_config)


@functools.cache
def model_class(architecture: str) -> type[nn.Module]:
    """vLLM's model class for ``architecture``, subclassed to hold what training kept."""
    base = _original(architecture)
    rename, fused = renamer_of(base), fused_of(base)

    class Kept(base):  # type: ignore[valid-type,misc]  # vLLM's classes are untyped here
        _fsdp_precision_model = True

        def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
            kept = kept_of_config(vllm_config)
            self_held: Held | None = None
            if kept is None or not kept.tensors:
                super().__init__(vllm_config=vllm_config, prefix=prefix)
            else:
                if DEGRADED:
                    refuse_uncovered("kept tensors")
                _refuse_if_untested(kept, str(vllm_config.model_config.model))
                _key_compile_cache(vllm_config, kept)
                engine_dtype = vllm_config.model_config.dtype
                with build(kept, architecture, rename, fused, engine_dtype) as current:
                    super().__init__(vllm_config=vllm_config, prefix=prefix)
                self_held = Held(
                    self,
                    current,
                    elsewhere=lambda name: is_pp_missing_parameter(name, self),
                    checkpoint_load=vllm_config.load_config.load_format != "dummy",
                )
                repair_expert_updates(self)
            self._fsdp_precision_held = self_held
            self._fsdp_precision_model_config = vllm_config.model_config

        def load_weights(self, weights: Any) -> Any:
            held = self._fsdp_precision_held
            if held is None:
                return super().load_weights(weights)
            try:
                return held.load(self, super().load_weights, weights, rename)
            except EngineDtypeError:  # raised after vLLM's load ran to its end
                _finish_reload(self, self._fsdp_precision_model_config)
                raise

    Kept.__name__ = Kept.__qualname__ = base.__name__
    Kept.__module__ = __name__
    Kept.__doc__ = base.__doc__
    return Kept


def __getattr__(name: str) -> type[nn.Module]:
    if name in ARCHITECTURES:
        return model_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
