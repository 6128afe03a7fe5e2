"""Reading back what an engine holds: a tensor in another dtype or with other values is named;
a module whose kernel hides its weight is probed through its own forward, and a weight rounded
to bf16 is told from an exact fp32 one computed by another GEMM (the negative control: the same
module with its weight rounded)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_precision import EngineDtypeError
from fsdp_precision._engines.readback import (
    TOLERANCE,
    compare_held,
    probe_linear,
    raise_problems,
)

pytestmark = pytest.mark.fast
bf16, fp32 = torch.bfloat16, torch.float32


def weight() -> torch.Tensor:
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(0)) * 0.05


def test_an_exact_tensor_passes_and_a_rounded_one_is_named() -> None:
    w = weight()
    assert compare_held("gate.weight", w.clone(), w, fp32) is None
    assert compare_held("gate.weight", w.to(bf16), w, fp32) == (
        "gate.weight: the engine holds it in bfloat16, training kept it in float32"
    )
    rounded = w.to(bf16).to(fp32)
    assert "held in float32 but not the loaded values" in str(compare_held("g", rounded, w, fp32))
    assert "holds shape (8, 32)" in str(compare_held("g", w[:, :32], w, fp32))


class Hidden(nn.Module):
    """A linear layer whose weight a kernel holds (vLLM's CPU prepack): an empty parameter, the
    computation in a closure, the input cast to the kernel's dtype."""

    def __init__(self, w: torch.Tensor, kernel_dtype: torch.dtype, out: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(0, dtype=kernel_dtype), requires_grad=False)
        packed = w.to(kernel_dtype).t().contiguous()  # another layout, another GEMM
        self.run = lambda x: (x.to(kernel_dtype) @ packed).to(out)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.run(x), None


@pytest.mark.parametrize(
    ("kernel", "out", "problem"),
    [
        (fp32, fp32, None),
        (bf16, fp32, r"computes it as if held in another dtype: its output is .* away"),
        (fp32, bf16, r"computes its module's output in bfloat16, training in float32"),
    ],
    ids=["kept", "rounded weight", "rounded logits"],
)
def test_a_hidden_weight_is_probed_through_the_module(
    kernel: torch.dtype, out: torch.dtype, problem: str | None
) -> None:
    w = weight()
    module = Hidden(w, kernel, out)
    found = probe_linear("gate.weight", lambda x: module(x)[0], w, None, fp32, bf16)
    if problem is None:
        assert found is None
    else:
        assert found is not None and found.startswith("gate.weight: ")
        import re

        assert re.search(problem, found), found


def test_the_tolerance_sits_between_an_fp32_gemm_and_bf16_rounding() -> None:
    w = weight()
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)).to(bf16).double()
    scale = (x.abs() @ w.double().abs().T).max().item()
    exact = F.linear(x, w.double())
    reordered = (x.float() @ w.t().contiguous().float()).double()  # another fp32 GEMM
    rounded = F.linear(x, w.to(bf16).double())
    assert (reordered - exact).abs().max().item() / scale < TOLERANCE / 10
    assert (rounded - exact).abs().max().item() / scale > TOLERANCE * 10


def test_problems_raise_together_with_the_fix() -> None:
    raise_problems([], "where", "fix")  # nothing to say: nothing raised
    with pytest.raises(EngineDtypeError, match=r"^vLLM: a; b; c; d; and 1 more\. Do this$"):
        raise_problems(["a", "b", "c", "d", "e"], "vLLM", "Do this")
