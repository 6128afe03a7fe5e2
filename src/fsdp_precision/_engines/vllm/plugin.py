"""vLLM's general plugin: how vLLM learns, in every process it starts, to hold what training kept.

vLLM runs the ``vllm.general_plugins`` entry points in each of its processes before any model is
built (``pyproject.toml`` names :func:`register`); a user starts vLLM as always. ``register``
replaces two layers in vLLM's out-of-tree layer registry (:mod:`.layers`), registers the
integration's model classes over vLLM's for the architectures it builds (:mod:`.models`),
registers the backend of vLLM's RL API ``fsdp_precision_gloo`` (:mod:`.rl`), and on vLLM's CPU
build lets ``enable_return_routed_experts`` work on the V1 model runner (:mod:`.routes`: it acts
only where that switch is on). The first two behave as vLLM's own unless the engine is told
that tensors are kept (an export's record, or a declaration: :func:`.hold.kept_of_config`): the
plugin does nothing without its trigger, and says in one log line what it changed where it acts.
``VLLM_PLUGINS`` (vLLM's own setting) turns it off.

vLLM does not catch what a plugin raises: a failure here would stop every launch in the
environment, stock models included. So each step is fenced: one that fails (a vLLM internal
that moved, a layer another plugin owns, a self-test that finds vLLM's constructor changed) is
undone, logged, and recorded in :data:`.layers.DEGRADED`, after which a model that keeps tensors
is refused by name and every other model loads as without the plugin.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

from fsdp_precision._engines.vllm.archs import ARCHITECTURES

__all__ = ["register"]

logger = logging.getLogger(__name__)

_MODELS = "fsdp_precision._engines.vllm.models"


def _layers() -> None:
    """The out-of-tree layers, each checked against the vLLM class it replaces."""
    from vllm.model_executor import custom_op  # lazy: the engine's registry

    from fsdp_precision._engines.vllm import layers  # lazy: imports vLLM

    for name, (cls, arguments) in layers.REPLACED.items():
        current = custom_op.op_registry_oot.get(name)
        if current is cls:
            continue
        if current is not None:
            raise RuntimeError(f"another vLLM plugin replaced {name} ({current.__module__})")
        vllm_cls = cls.__mro__[1]
        parameters = inspect.signature(vllm_cls.__init__).parameters  # type: ignore[misc]
        missing = set(arguments) - set(parameters)
        if vllm_cls.__name__ != name or missing:
            raise RuntimeError(f"vLLM's {name} is not the layer built here (lacks {missing})")
        custom_op.PluggableLayer.register_oot(name=name)(cls)
        if custom_op.maybe_get_oot_by_class(vllm_cls) is not cls:  # what vLLM will build
            del custom_op.op_registry_oot[name]
            raise RuntimeError(f"vLLM does not build the registered {name}")


def _models() -> None:
    """The integration's model classes over vLLM's, for the architectures it builds."""
    from vllm.model_executor.models.registry import ModelRegistry  # lazy: the engine's registry

    from fsdp_precision._engines.vllm import models  # lazy: imports vLLM

    supported = set(ModelRegistry.get_supported_archs())
    for architecture in ARCHITECTURES:
        entry = ModelRegistry.models.get(architecture)
        if architecture not in supported or getattr(entry, "module_name", "") == _MODELS:
            continue
        models.ORIGINALS[architecture] = entry
        ModelRegistry.register_model(architecture, f"{_MODELS}:{architecture}")


def _degrade(step: str, err: BaseException) -> None:
    """Record why ``step`` failed; where even that fails, say so: the launch goes on."""
    reason = f"{step}: {type(err).__name__}: {err}"
    try:
        from fsdp_precision._engines.vllm.layers import DEGRADED  # lazy: imports vLLM

        if reason not in DEGRADED:
            DEGRADED.append(reason)
    except Exception as inner:  # noqa: BLE001 - nothing may stop vLLM's launch
        reason += f" (and kept models cannot be refused here: {inner})"
    logger.error(
        "fsdp-precision: its vLLM plugin could not register (%s); models that keep tensors are "
        "refused by name, every other model loads as without the plugin",
        reason,
    )


def _backend() -> None:
    """vLLM's RL API's backend ``fsdp_precision_gloo`` (:mod:`.rl`), in its factories."""
    from fsdp_precision._engines.vllm.rl import register_backend  # lazy: imports vLLM

    register_backend()


def _routes() -> None:
    """vLLM's routed-experts capture on its CPU build's V1 model runner (:mod:`.routes`); that
    step fences itself (a failure refuses ``enable_return_routed_experts`` by name, and leaves
    kept models alone)."""
    from fsdp_precision._engines.vllm.routes import install  # lazy: vLLM's internals

    install()


_STEPS: tuple[tuple[str, Callable[[], None]], ...] = (
    ("the layers", _layers),
    ("the model classes", _models),
    ("the weight-transfer backend", _backend),
    ("the routed-experts capture", _routes),
)


def register() -> None:
    """Register the integration with the vLLM of this process (idempotent; never raises)."""
    for step, run in _STEPS:
        try:
            run()
        except Exception as err:  # noqa: BLE001 - vLLM does not catch what a plugin raises
            _degrade(step, err)
