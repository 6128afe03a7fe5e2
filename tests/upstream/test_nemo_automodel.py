"""NeMo Automodel's FSDP2 precision reports, on one gloo rank (docs/known-issues.md).

#3327/#3328: a custom MoE with fp32 master weights crashed ("expected m1 and m2 to have the same
dtype") because each parameter's compute dtype was resolved from a module-wide flag: one
natively bf16 sibling made every fp32 master weight of the layer compute in fp32. Here compute
dtypes come from the rules, per parameter, whatever the siblings are stored in: in one unit, an
fp32-stored projection computes in bf16 beside a bf16-stored sibling and an fp32 router kept by
a rule. torch alone refuses the mixed storage (the negative control).

#3708: code that reads ``weight.dtype`` to pick an activation dtype. Inside its unit's forward
every parameter reads as its compute dtype under the map (the kept router fp32, the rest bf16);
outside its unit's forward torch shows the sharded storage, as it does without the library.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fsdp_precision as fp
from fsdp_precision.testing import GatherProbe

from tests.support.harness import unpatched

pytestmark = pytest.mark.usefixtures("world1")
bf16, fp32 = torch.bfloat16, torch.float32


class Layer(nn.Module):
    """Qwen3.5-MoE's shape of the trigger: an fp32 master projection, a natively bf16 shared
    expert gate, a router."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(8, 8, bias=False)  # fp32 master, computes in bf16
        self.shared_expert_gate = nn.Linear(8, 1, bias=False).to(bf16)  # stored bf16
        self.gate = nn.Linear(8, 4, bias=False)  # the router, kept in fp32
        self.seen: dict[str, torch.dtype] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = {n: p.dtype for n, p in self.named_parameters()}  # what weight.dtype says
        h = self.in_proj(x)
        route = F.softmax(self.gate(h.to(self.gate.weight.dtype)), -1)
        return h * torch.sigmoid(self.shared_expert_gate(h)) + route.sum(-1, keepdim=True).to(
            h.dtype
        )


RULES = fp.PrecisionRules(param_dtype=bf16, reduce_dtype=fp32, rules=(fp.Glob("gate.weight"),))


def test_3327_compute_dtype_is_per_parameter_whatever_the_siblings_store() -> None:
    torch.manual_seed(0)
    layer = Layer()
    fp.compile_param_dtype_maps(layer, RULES, [layer]).apply()
    with GatherProbe(layer) as probe:
        out = layer(torch.randn(4, 8, dtype=bf16))
        out.float().sum().backward()
    seen = {n: g.dtype for n, g in probe.seen.items()}
    assert seen == {"in_proj.weight": bf16, "shared_expert_gate.weight": bf16, "gate.weight": fp32}
    assert out.dtype == bf16
    # Each sharded gradient lands in its parameter's storage dtype.
    grads = {n: p.grad.dtype for n, p in layer.named_parameters()}
    assert grads == {"in_proj.weight": fp32, "shared_expert_gate.weight": bf16, "gate.weight": fp32}


def test_3327_torch_alone_refuses_the_mixed_storage() -> None:
    layer = Layer()
    with unpatched(), pytest.raises(AssertionError, match="uniform original parameter dtype"):
        fully_shard(layer, mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))
        layer(torch.randn(4, 8, dtype=bf16))


def test_3708_weight_dtype_inside_the_unit_is_the_compute_dtype() -> None:
    torch.manual_seed(0)
    layer = Layer()
    fp.compile_param_dtype_maps(layer, RULES, [layer]).apply()
    assert layer.in_proj.weight.dtype == fp32  # outside the forward: the sharded storage
    layer(torch.randn(4, 8, dtype=bf16))
    assert layer.seen == {
        "in_proj.weight": bf16,
        "shared_expert_gate.weight": bf16,
        "gate.weight": fp32,
    }
