"""The integration's model classes: vLLM's own, subclassed, registered in vLLM's model registry
under the same architecture names (:func:`.plugin.register`), resolved lazily by vLLM from
``fsdp_precision._engines.vllm.models:<Architecture>``.

Without the library's export record beside the model directory the subclass is vLLM's class:
``__init__`` and ``load_weights`` go straight to it. With one, the model is built inside
:func:`.hold.build` (so its routers are built in the kept dtype), then :class:`.hold.Held`
converts or refuses the rest before any weight is read, every load is read back, and updates
repair the expert layouts vLLM's update path leaves unprocessed (:mod:`.experts`).

Imports vLLM: resolved only inside vLLM's processes.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch.nn as nn
import vllm
from vllm.model_executor.models.registry import ModelRegistry

from fsdp_precision._engines.kept import kept_of_export
from fsdp_precision._engines.vllm.archs import ARCHITECTURES, TESTED_VLLM
from fsdp_precision._engines.vllm.experts import repair_expert_updates
from fsdp_precision._engines.vllm.hold import Held, build, fused_of, renamer_of

__all__ = ["ORIGINALS", "model_class"]

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


@functools.cache
def _warn_if_untested() -> None:
    """Once, where a kept model is built: a vLLM the integration was not run against."""
    version = str(vllm.__version__).split("+")[0]
    if version not in TESTED_VLLM:
        logger.warning(
            "fsdp-precision: vLLM %s is not a release its integration was run against (%s); "
            "every kept tensor is still read back after each load",
            version,
            ", ".join(TESTED_VLLM),
        )


@functools.cache
def model_class(architecture: str) -> type[nn.Module]:
    """vLLM's model class for ``architecture``, subclassed to hold what training kept."""
    base = _original(architecture)
    rename, fused = renamer_of(base), fused_of(base)

    class Kept(base):  # type: ignore[valid-type,misc]  # vLLM's classes are untyped here
        _fsdp_precision_model = True

        def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
            kept = kept_of_export(vllm_config.model_config.model)
            self_held: Held | None = None
            if kept is None:
                super().__init__(vllm_config=vllm_config, prefix=prefix)
            else:
                _warn_if_untested()
                with build(kept, architecture, rename, fused) as current:
                    super().__init__(vllm_config=vllm_config, prefix=prefix)
                self_held = Held(self, current)
                repair_expert_updates(self)
            self._fsdp_precision_held = self_held

        def load_weights(self, weights: Any) -> Any:
            held = self._fsdp_precision_held
            if held is None:
                return super().load_weights(weights)
            return held.load(self, super().load_weights, weights, rename)

    Kept.__name__ = Kept.__qualname__ = base.__name__
    Kept.__module__ = __name__
    Kept.__doc__ = base.__doc__
    return Kept


def __getattr__(name: str) -> type[nn.Module]:
    if name in ARCHITECTURES:
        return model_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
