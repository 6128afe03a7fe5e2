"""vLLM's routed-experts capture through a compiled graph on its CPU build (:mod:`.routes`).

vLLM binds its capture to each router as a Python callback (``BaseRouter.capture_fn``: a write of
the router's expert ids into ``RoutedExpertsCapturer``'s buffer) when it builds the connector,
with the KV cache. On a GPU the MoE layer is an opaque op (``torch.ops.vllm.moe_forward``), so the
callback runs eagerly whenever the graph was traced. vLLM 0.32's CPU build calls the MoE layer
directly, so Dynamo traces the router into the model's graph, and it traces that graph at its
warm-up, before the KV cache, once (``DYNAMO_TRACE_ONCE``: no guards, no retrace): the callback,
bound later, never ran (every row came back zero). Here every router calls the opaque op
``fsdp_precision::capture_routed_experts`` from the model's build on (:func:`bind`), and again
after vLLM has bound its callbacks: the graph keeps the call (its schema declares a write to the
ids, so it is never eliminated; it writes nothing to them), and at run time the op hands the ids
to vLLM's capturer of the step running in this process (:func:`stepping`); outside a step
(warm-up, profiling) it does nothing. Eager, it is the same call.

Imports torch only; the op is defined by :func:`define`, from :func:`.routes.install`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["OP", "bind", "define", "stepping"]

#: The op's qualified name (``torch.ops.fsdp_precision.capture_routed_experts``).
OP = "fsdp_precision::capture_routed_experts"

_STEP: list[Any] = [None]  # vLLM's capturer of the step running in this process, or None


def _capture(topk_ids: torch.Tensor, layer_id: int) -> None:
    capturer = _STEP[0]
    if capturer is not None:  # None: a warm-up or profiling forward, nothing to return
        capturer.capture(layer_id, topk_ids)


@functools.cache
def define() -> Any:
    """The op (defined once per process: a graph compiled or loaded later calls it by name)."""
    op = torch.library.custom_op(OP, mutates_args=("topk_ids",))(_capture)
    op.register_fake(lambda topk_ids, layer_id: None)
    return op


def _through_op(layer_id: int, topk_ids: torch.Tensor) -> None:
    torch.ops.fsdp_precision.capture_routed_experts(topk_ids, layer_id)


def bind(model: torch.nn.Module) -> int:
    """Make every MoE router of ``model`` call the op (the number bound): before the graph is
    traced (the CPU build compiles at warm-up, before vLLM binds its capture with the KV cache),
    and again after vLLM has bound its callbacks."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner  # lazy: vLLM's
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
        RoutedExpertsCaptureSource,
    )
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter  # lazy: vLLM

    define()
    replaced = 0
    for module in model.modules():
        if isinstance(module, RoutedExpertsCaptureSource):
            owner, layer_id = module, module.layer_id
        elif isinstance(module, MoERunner) and isinstance(module.router, BaseRouter):
            owner, layer_id = module.router, module.layer_id
        else:
            continue
        owner.capture_fn = functools.partial(_through_op, layer_id)
        replaced += 1
    return replaced


@contextmanager
def stepping(capturer: Any) -> Iterator[None]:
    """Route the op's calls to ``capturer`` for one step's forward."""
    _STEP[0] = capturer
    try:
        yield
    finally:
        _STEP[0] = None
