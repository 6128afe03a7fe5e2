"""Small models and helpers shared by the distributed cases."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from tests.support.harness import seeded

bf16, fp16, fp32, fp64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


class Block(nn.Module):
    """Pre-norm MLP block with an MoE-style router that computes in its own weight's dtype."""

    def __init__(self, dim: int = 16, hidden: int = 24, experts: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.gate = nn.Linear(dim, experts, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        # Like HF MoE routers: the router runs in its weight's dtype, the result is cast back.
        route = self.gate(h.to(self.gate.weight.dtype)).softmax(-1).to(h.dtype)
        return x + self.down(F.gelu(self.up(h))) * route.mean(-1, keepdim=True)


class Net(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 2, hidden: int = 24) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


#: The plain bf16 policy, and a kept module's own fp32 unit (the separate-units layout).
STD = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
FP32_CHILD = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)

#: FQNs, relative to a Block, that models keep in fp32 (norm and router).
KEEP_IN_BLOCK = ("norm.weight", "norm.bias", "gate.weight")


def net(seed: int = 0, **kwargs: int) -> Net:
    with seeded(seed):  # ranks that are threads share torch's generator
        return Net(**kwargs)


def mixed_storage_net(**kwargs: int) -> Net:
    """A Net stored in bf16 whose kept parameters (``KEEP_IN_BLOCK``, the tail norm) are stored
    in fp32: mixed storage in one unit."""
    model = net(**kwargs)
    model.to(torch.bfloat16)
    for block in model.blocks:
        block.norm.float()
        block.gate.float()
    model.norm.float()
    return model


def clones(model: nn.Module, n: int) -> list[nn.Module]:
    return [copy.deepcopy(model) for _ in range(n)]


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.to_local() if isinstance(t, DTensor) else t


def assert_same_grads(a: nn.Module, b: nn.Module) -> None:
    """Every sharded gradient bitwise equal, dtypes included (None matches None only)."""
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        ga, gb = local(pa.grad), local(pb.grad)
        if ga is None or gb is None:
            assert ga is None and gb is None, f"{name}: grad {ga is None=} {gb is None=}"
            continue
        assert ga.dtype == gb.dtype, f"{name}: grad dtype {ga.dtype} != {gb.dtype}"
        assert torch.equal(ga, gb), f"{name}: grads differ, max {(ga - gb).abs().max()}"


def assert_same_params(a: nn.Module, b: nn.Module) -> None:
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        la, lb = local(pa), local(pb)
        assert la.dtype == lb.dtype, f"{name}: dtype {la.dtype} != {lb.dtype}"
        assert torch.equal(la, lb), f"{name}: params differ"


def inputs(step: int, dim: int = 16, batch: int = 4) -> torch.Tensor:
    """Different data on every rank and step."""
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(batch, dim, generator=g)


def loss_of(y: torch.Tensor) -> torch.Tensor:
    return y.float().pow(2).mean()


def train_in_lockstep(
    models: Iterable[nn.Module],
    steps: int = 3,
    check: Callable[[nn.Module, nn.Module], None] | None = None,
    make_input: Callable[[int], torch.Tensor] = inputs,
) -> None:
    """Train several wrapped copies side by side; outputs, losses, grads, params bitwise equal."""
    models = list(models)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for step in range(steps):
        x = make_input(step)
        outs = [m(x) for m in models]
        for out in outs[1:]:
            assert out.dtype == outs[0].dtype and torch.equal(out, outs[0]), f"step {step}: out"
        losses = [loss_of(o) for o in outs]
        for loss in losses:
            loss.backward()
        for other in models[1:]:
            assert_same_grads(models[0], other)
            if check is not None:
                check(models[0], other)
        for opt in optims:
            opt.step()
            opt.zero_grad()
        for other in models[1:]:
            assert_same_params(models[0], other)


class RoutedBlock(nn.Module):
    """A pre-norm block whose router, like Qwen3-MoE's, takes its input as it comes (kept in
    fp32 it needs its boundary cast) and picks the top 2 of 4 experts by softmax scores."""

    def __init__(self, dim: int = 16, hidden: int = 32, experts: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.gate = nn.Linear(dim, experts, bias=False)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        scores = self.gate(h).softmax(-1)
        top, idx = scores.topk(2, dim=-1)
        weights = torch.zeros_like(scores).scatter(-1, idx, top).sum(-1, keepdim=True)
        return x + self.down(F.silu(self.up(h))) * weights.to(h.dtype)


class RoutedNet(nn.Module):
    """Blocks of :class:`RoutedBlock`, a final norm and a head."""

    _no_split_modules = ("RoutedBlock",)

    def __init__(self, dim: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(RoutedBlock(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
