"""A traced forward of a transformers model that reaches its end on the meta device and in fp32.

transformers' fused MoE experts dispatch on ``config._experts_implementation``. Its default,
``"grouped_mm"``, calls ``torch._grouped_mm``, whose meta and CPU kernels accept bf16 only
("Expected inputs of BF16 type but got mat_a.dtype=torch.float32"): a traced forward of an fp32
or meta-device Qwen3-MoE stops at its first expert layer. ``"batched_mm"`` (an index of the
expert weights and a ``bmm``, any dtype and device) computes the same product, so a trace
switches to it while it runs. Models without the attribute are untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.nn as nn

__all__ = ["traceable_experts"]

_INTERNAL = "_experts_implementation_internal"
#: The implementations a meta-device or fp32 forward cannot run.
_BF16_ONLY = (None, "grouped_mm")


@contextmanager
def traceable_experts(model: nn.Module) -> Iterator[None]:
    """While entered, every config of ``model`` that would dispatch fused experts to
    ``grouped_mm`` dispatches them to ``batched_mm``; restored on exit."""
    saved: list[tuple[Any, object]] = []
    seen: set[int] = set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen or not hasattr(config, _INTERNAL):
            continue
        seen.add(id(config))
        current = getattr(config, _INTERNAL)
        if current in _BF16_ONLY:
            saved.append((config, current))
            setattr(config, _INTERNAL, "batched_mm")
    try:
        yield
    finally:
        for config, current in saved:
            setattr(config, _INTERNAL, current)
