"""Tensors against their reference: same bits, or the largest difference and its scale.

Also what a model's output and loss are judged by. Public through :mod:`fsdp_precision.testing`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = [
    "BITWISE_WORLD_SIZES",
    "Comparison",
    "compare",
    "gradient_tolerance",
    "loss_of",
    "output_of",
    "same_bits",
]

#: Gradients are bitwise on these world sizes (with identical inputs on every rank).
BITWISE_WORLD_SIZES = (1, 2)


@dataclass(frozen=True)
class Comparison:
    """One tensor against its reference.

    Attributes:
        bitwise: Same dtype, shape and bits (``torch.equal``).
        max_abs_diff: ``max |got - expected|`` in float64 (``inf`` for a shape or NaN mismatch).
        scale: ``max |expected|``, the scale a tolerance is relative to.
    """

    bitwise: bool
    max_abs_diff: float
    scale: float

    def within(self, rtol: float | None) -> bool:
        """Bitwise, or (when ``rtol`` is given) ``max_abs_diff <= rtol * scale``."""
        if self.bitwise:
            return True
        return rtol is not None and self.max_abs_diff <= rtol * self.scale

    def describe(self) -> str:
        """``"bitwise"``, or the largest difference (``"3.05e-05"``)."""
        return "bitwise" if self.bitwise else f"{self.max_abs_diff:.3g}"


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaNs with the same bits included): the bitwise check."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if torch.equal(a, b):
        return True
    if not a.is_floating_point():
        return False
    as_int = _SAME_SIZE_INT[a.element_size()]  # NaNs with the same bits are the same bits
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


def compare(got: torch.Tensor, expected: torch.Tensor) -> Comparison:
    """Compare two plain tensors: same dtype, shape and bits; the max absolute difference."""
    finite = expected.detach()[torch.isfinite(expected.detach())] if expected.numel() else None
    scale = float(finite.double().abs().max()) if finite is not None and finite.numel() else 0.0
    if got.shape != expected.shape:
        return Comparison(False, math.inf, scale)
    same = same_bits(got.detach(), expected.detach())
    if same or not got.numel():
        return Comparison(same, 0.0, scale)
    diff = float((got.detach().double() - expected.detach().double()).abs().max())
    return Comparison(False, diff if not math.isnan(diff) else math.inf, scale)


def gradient_tolerance(world_size: int, reduce_dtype: torch.dtype) -> float | None:
    """Relative tolerance of a reduced gradient: ``None`` (bitwise) on 1 and 2 ranks.

    On N ranks FSDP sums N copies of the same gradient (in ``reduce_dtype``) and divides by N;
    each of the N - 1 additions and the division rounds at most half an ulp, so
    ``max |got - expected| <= N * eps(reduce_dtype) * max |expected|`` bounds it.
    """
    if world_size in BITWISE_WORLD_SIZES:
        return None
    return world_size * torch.finfo(reduce_dtype).eps


def output_of(out: Any) -> torch.Tensor:
    """The tensor a model's output is judged by: ``logits``/``sample``, else the first tensor."""
    if isinstance(out, torch.Tensor):
        return out
    for name in ("logits", "sample", "last_hidden_state"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    leaves, _ = tree_flatten(out)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf
    raise ValueError(f"the model returned no floating tensor ({type(out).__name__})")


def loss_of(out: Any) -> torch.Tensor:
    """``out.loss`` when the model computed one, else ``output_of(out).float().pow(2).mean()``."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    return output_of(out).float().pow(2).mean()
