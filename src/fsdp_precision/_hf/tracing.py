"""A traced forward of a transformers model that reaches its end on the meta device and in fp32.

What stops it is undone here while the trace runs: fused MoE experts (:func:`traceable_experts`),
the key/value cache (:func:`traceable_cache`: a training forward has none) and the shortcuts
that read a tensor's values (:func:`traceable_meta`).

transformers' fused MoE experts dispatch on ``config._experts_implementation``. Its default,
``"grouped_mm"``, calls ``torch._grouped_mm``, whose meta and CPU kernels accept bf16 only
("Expected inputs of BF16 type but got mat_a.dtype=torch.float32"): a traced forward of an fp32
or meta-device Qwen3-MoE stops at its first expert layer. ``"batched_mm"`` (an index of the
expert weights and a ``bmm``, any dtype and device) computes the same product, so a trace
switches to it while it runs. Models without the attribute are untouched.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn

__all__ = ["traceable_cache", "traceable_experts", "traceable_meta"]

_INTERNAL = "_experts_implementation_internal"
#: The implementations a meta-device or fp32 forward cannot run.
_BF16_ONLY = (None, "grouped_mm")


@contextmanager
def traceable_experts(model: nn.Module, implementation: str = "batched_mm") -> Iterator[None]:
    """While entered, every config of ``model`` that would dispatch fused experts to
    ``grouped_mm`` dispatches them to ``implementation``; restored on exit. ``"batched_mm"``
    runs on the meta device; on values it gathers each token's expert weights (tokens x top-k
    weight matrices), where ``"eager"`` (the model's own loop over the experts hit) holds one
    expert's activations at a time."""
    saved: list[tuple[Any, object]] = []
    for config in _configs(model):
        if not hasattr(config, _INTERNAL):
            continue
        current = getattr(config, _INTERNAL)
        if current in _BF16_ONLY:
            saved.append((config, current))
            setattr(config, _INTERNAL, implementation)
    try:
        yield
    finally:
        for config, current in saved:
            setattr(config, _INTERNAL, current)


def _configs(model: nn.Module) -> list[Any]:
    """Every config of ``model``'s modules, once each."""
    found: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None:
            found.setdefault(id(config), config)
    return list(found.values())


@contextmanager
def traceable_cache(model: nn.Module) -> Iterator[None]:
    """While entered, ``use_cache`` is off in every config of ``model``, as in training (a
    hybrid model's default config can ask for a cache its layers cannot fill: Bamba's
    ``get_seq_length`` on linear-attention layers only, Blenderbot's cache index); restored
    on exit."""
    saved = [c for c in _configs(model) if getattr(c, "use_cache", None) is True]
    for config in saved:
        config.use_cache = False
    try:
        yield
    finally:
        for config in saved:
            config.use_cache = True


def _is_fake_or_meta(original: Any) -> Any:
    def is_fake_tensor(x: Any) -> bool:
        return bool(original(x)) or (isinstance(x, torch.Tensor) and x.is_meta)

    return is_fake_tensor


@contextmanager
def traceable_meta() -> Iterator[None]:
    """While entered, transformers takes a meta tensor for what it is: a tensor with a shape
    and a dtype and no values, as torch.compile's fake tensors are. Its ``is_tracing(tensor)``
    then holds for meta tensors, so the shortcuts that read values (is this padding mask all
    ones, are these positions packed sequences: ``Tensor.item() cannot be called on meta
    tensors``) are skipped as they are under torch.compile. Nothing happens where transformers
    is not imported; restored on exit."""
    import_utils: Any = sys.modules.get("transformers.utils.import_utils")
    original = getattr(import_utils, "is_fake_tensor", None)
    if original is None:
        yield
        return
    import_utils.is_fake_tensor = _is_fake_or_meta(original)
    try:
        yield
    finally:
        import_utils.is_fake_tensor = original
