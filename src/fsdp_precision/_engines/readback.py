"""Reading back what an engine holds for each kept tensor, or what it computes where a kernel
hides the weight, and naming what it rounded.

Engines keep a weight behind their kernels: vLLM's CPU build replaces a linear layer's weight by
a prepacked handle (the parameter becomes an empty tensor), so "kept" is checked by what the
module computes on a probe where precision decides: its output against the kept weight's, and
against the same weight rounded to the bulk dtype. An fp32 GEMM differs from another fp32 GEMM
by accumulation order (about 1e-7 of the output's scale); a weight rounded to bf16 moves the
output by about 1e-3 of it, so the two never meet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._base.errors import EngineDtypeError

__all__ = ["TOLERANCE", "compare_held", "probe_linear", "raise_problems"]

#: The largest output error, as a share of the output's scale (``|x| @ |W|^T``), a module may
#: show against its kept weight: far above an fp32 GEMM's reordering, far below bf16 rounding.
TOLERANCE = 2.0**-14


def compare_held(
    name: str, held: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype
) -> str | None:
    """What is wrong with the engine's tensor ``held`` for the kept ``name``: not in ``dtype``, or
    not ``expected`` (what was loaded) bit for bit in it. ``None`` when it is exact."""
    if held.dtype != dtype:
        return (
            f"{name}: the engine holds it in {dtype_name(held.dtype)}, training kept it in "
            f"{dtype_name(dtype)}"
        )
    if tuple(held.shape) != tuple(expected.shape):
        shapes = f"{tuple(held.shape)}, the weights {tuple(expected.shape)}"
        return f"{name}: the engine holds shape {shapes}"
    want = expected.detach().to("cpu", dtype)
    if not torch.equal(held.detach().cpu(), want):
        diff = (held.detach().cpu().double() - want.double()).abs().max().item()
        return (
            f"{name}: held in {dtype_name(dtype)} but not the loaded values (max |diff| {diff:.3g})"
        )
    return None


def probe(features: int, rows: int = 32, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Deterministic probe activations in the dtype an engine feeds its layers."""
    g = torch.Generator().manual_seed(1234)
    return torch.randn(rows, features, generator=g).to(dtype)


def probe_linear(
    name: str,
    forward: Callable[[torch.Tensor], torch.Tensor],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    bulk: torch.dtype,
    device: torch.device | str = "cpu",
) -> str | None:
    """What is wrong with how the engine's linear module (``forward``: its own call on a probe
    in ``bulk``) computes the kept ``weight`` (and ``bias``): logits not in ``dtype``, or an
    output farther from the kept weight's than :data:`TOLERANCE` (a weight rounded to ``bulk``).
    ``None`` when it computes as training did."""
    x = probe(weight.shape[1], dtype=bulk)
    out = forward(x.to(device)).detach().cpu()
    w = weight.detach().cpu().double()
    b = None if bias is None else bias.detach().cpu().double()
    reference = F.linear(x.double(), w, b)
    scale = (x.double().abs() @ w.abs().T).max().item() or 1.0
    error = (out.double() - reference).abs().max().item() / scale
    rounded = F.linear(x.double(), weight.detach().cpu().to(bulk).double(), b)
    rounding = (rounded - reference).abs().max().item() / scale
    if out.dtype != dtype:
        return (
            f"{name}: the engine computes its module's output in {dtype_name(out.dtype)}, "
            f"training in {dtype_name(dtype)}"
        )
    if error > TOLERANCE:
        return (
            f"{name}: the engine computes it as if held in another dtype: its output is "
            f"{error:.1e} of the output's scale away from the kept weight's (rounding the weight "
            f"to {dtype_name(bulk)} moves it {rounding:.1e}; an exact {dtype_name(dtype)} "
            f"weight stays under {TOLERANCE:.1e})"
        )
    return None


def raise_problems(problems: Sequence[str], where: str, fix: str) -> None:
    """Raise :class:`EngineDtypeError` listing ``problems`` (the first few), if any."""
    if not problems:
        return
    shown = "; ".join(problems[:4]) + (
        f"; and {len(problems) - 4} more" if len(problems) > 4 else ""
    )
    raise EngineDtypeError(f"{where}: {shown}. {fix}")
