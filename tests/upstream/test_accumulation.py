"""Gradient accumulation with a kept fp32 parameter that gets several gradient contributions per
step (issue 52; torch 2.15's deferred upcast, pytorch #198668 / #199242), on 2 gloo ranks.

The grid (:data:`VARIANTS`): how the parameters are stored (all fp32; the bulk bf16 beside a
kept fp32 module; all bf16 with the kept module upcast exactly by ``model_policy``), how often the
kept module contributes to its gradient per forward (once; entered twice; twice through a tied
twin), and the accumulation window (3 microbatches each reduced, torch's default; or the first two
under ``set_requires_gradient_sync(False)``). Three layouts of the same block, one seed:

- ``in_unit``: the library's map, the kept module inside the bf16 unit;
- ``separate``: the public-API workaround, the kept module its own fp32 unit (a tied pair one
  grouped unit: torch cannot shard a parameter across units);
- ``plain``: the unsharded model, autograd accumulating ``.grad`` over the window, averaged over
  the ranks at each reduced microbatch (what DDP does): the model's own summation order.

Every sharded gradient (dtype and value) and every parameter after each of two SGD steps is
bitwise the separate-units layout's, and the kept gradients of the first window are bitwise the
plain model's, with one exception, torch's own: a unit entered twice per forward after a
microbatch without sync. torch registers one post-backward hook per entry; the hook of the last
entry fires before autograd has accumulated this microbatch's gradient, finds the earlier
microbatches' sum in the unsharded gradient and reduce-scatters it alone, and the rest follows in
a second reduce-scatter: RS(S) + RS(g) instead of RS(S + g). There the separate units differ from
both the plain model and the library by an ulp (asserted, so that the documentation's account
stays true), and the library is bitwise the plain model (docs/known-issues.md).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fsdp_precision as fp

from tests.support.harness import distributed_suite

bf16, fp32 = torch.bfloat16, torch.float32
D, STEPS, MICRO = 16, 2, 3
KEPT = ("kept.weight", "kept.bias")


@dataclass(frozen=True)
class Variant:
    """One cell of the grid."""

    storage: str  # "fp32" | "mixed" | "upcast"
    contributions: str  # "once" | "twice" | "tied"
    window: str  # "each_reduced" | "no_sync"

    @property
    def name(self) -> str:
        return f"{self.storage}_{self.contributions}_{self.window}"

    @property
    def torch_splits_the_reduce(self) -> bool:
        """Where torch's separate unit reduces the window in two parts (see the module doc)."""
        return self.contributions == "twice" and self.window == "no_sync"


VARIANTS = [
    Variant(*cell)
    for cell in itertools.product(
        ("fp32", "mixed", "upcast"), ("once", "twice", "tied"), ("each_reduced", "no_sync")
    )
]


class Bulk(nn.Linear):
    """A bf16 layer; the plain model casts for itself what FSDP's bf16 unit gathers."""

    cast: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cast is None:
            return super().forward(x)
        return F.linear(x.to(self.cast), self.weight.to(self.cast), self.bias.to(self.cast))


class Block(nn.Module):
    def __init__(self, variant: Variant) -> None:
        super().__init__()
        self.lin1, self.kept, self.lin2 = Bulk(D, D), nn.Linear(D, D), Bulk(D, D)
        self.twin: nn.Linear | None = None
        if variant.contributions == "tied":
            self.twin = nn.Linear(D, D)
            self.twin.weight, self.twin.bias = self.kept.weight, self.kept.bias
        self.calls = 1 if variant.contributions == "once" else 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin1(x)
        y = h
        for call in range(self.calls):
            kept = self.twin if call == 1 and self.twin is not None else self.kept
            y = torch.tanh(kept(y.float()).to(y.dtype)) + h  # the model casts for the kept one
        return self.lin2(y)


def build(variant: Variant, layout: str) -> Block:
    torch.manual_seed(0)
    block = Block(variant)
    if variant.storage != "fp32":
        block.to(bf16)
        if variant.storage == "mixed" or layout != "in_unit":
            block.kept.float()  # "upcast" in_unit: model_policy upcasts it (plan.upcasts)
    if layout == "plain":
        block.lin1.cast = block.lin2.cast = bf16
        return block
    if layout == "separate":
        kept = [block.kept, block.twin] if block.twin is not None else block.kept
        fully_shard(kept, mp_policy=MixedPrecisionPolicy(param_dtype=None, reduce_dtype=fp32))
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))
        return block
    if variant.storage == "upcast":
        rules = fp.PrecisionRules(
            param_dtype=bf16, reduce_dtype=fp32, rules=(fp.Glob("kept.*"),), advice="off"
        )
        policy = fp.model_policy(block, rules)
        assert block.kept.weight.dtype == fp32  # upcast exactly, in place
    else:
        policy = fp.ParamDtypeMixedPrecisionPolicy(
            param_dtype=bf16, reduce_dtype=fp32, param_dtype_map=dict.fromkeys(KEPT, fp32)
        )
    fully_shard(block, mp_policy=policy)
    return block


def batch(step: int, micro: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    return torch.randn(4, D, generator=generator)


def reduced(variant: Variant, micro: int) -> bool:
    return variant.window == "each_reduced" or micro == MICRO - 1


Record = list[dict[str, torch.Tensor]]


def train_sharded(variant: Variant, layout: str) -> tuple[Record, Record]:
    """Each step's sharded gradients (after the window) and parameters (after SGD)."""
    block = build(variant, layout)
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    grads: Record = []
    params: Record = []
    for step in range(STEPS):
        for micro in range(MICRO):
            block.set_requires_gradient_sync(reduced(variant, micro))  # type: ignore[operator]
            block(batch(step, micro)).float().pow(2).mean().backward()
        grads.append({n: p.grad.to_local().clone() for n, p in block.named_parameters()})
        opt.step()
        opt.zero_grad()
        params.append({n: p.detach().to_local().clone() for n, p in block.named_parameters()})
    return grads, params


def plain_kept_grads(variant: Variant) -> dict[str, torch.Tensor]:
    """This rank's shard of the kept gradients after the first window, as the unsharded model
    accumulates them (DDP's ``no_sync``: the local sum averaged at each reduced microbatch)."""
    block = build(variant, "plain")
    out: dict[str, torch.Tensor] = {}
    for micro in range(MICRO):
        block(batch(0, micro)).float().pow(2).mean().backward()
        if not reduced(variant, micro):
            continue
        for name in KEPT:
            param = block.get_parameter(name)
            assert param.grad is not None
            grad = param.grad.clone()
            dist.all_reduce(grad)  # a sum of two: the order cannot matter
            grad /= dist.get_world_size()
            out[name] = out[name] + grad if name in out else grad
            param.grad = None
    return {n: g.chunk(dist.get_world_size())[dist.get_rank()] for n, g in out.items()}


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return [n for n in a if a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]


def check(variant: Variant) -> dict[str, Any]:
    in_unit, separate = train_sharded(variant, "in_unit"), train_sharded(variant, "separate")
    stored = {n: p.dtype for n, p in build(variant, "in_unit").named_parameters()}
    for grads in in_unit[0]:
        assert {n: g.dtype for n, g in grads.items()} == stored  # each in its storage dtype
    split = variant.torch_splits_the_reduce
    for ours, theirs in zip(in_unit[0] + in_unit[1], separate[0] + separate[1], strict=True):
        diff = differing(ours, theirs)
        assert set(diff) <= (set(KEPT) if split else set()), (variant, diff)
    plain = plain_kept_grads(variant)
    first = {n: in_unit[0][0][n] for n in KEPT}
    assert not differing(first, plain), variant  # the model's own order, in every cell
    if split:  # torch's separate unit is the one that differs from it
        assert differing({n: separate[0][0][n] for n in KEPT}, plain), variant
    return {"split": split}


for _variant in VARIANTS:
    globals()[f"case_{_variant.name}"] = functools.partial(check, _variant)

CASES = [f"case_{v.name}" for v in VARIANTS]
results, test_accumulation = distributed_suite(2, __name__, CASES)
