"""A tiny MoE language model whose experts are separate modules and whose routing the test
decides: the trigger of the field's late-parameter reports (pytorch #196996).

Each token goes to expert ``token_id % experts`` (hash routing), weighted by the router's
softmax, so the router gate (kept in fp32 by :data:`RULES`) gets a gradient on every microbatch
while an expert gets one only on the microbatches whose tokens reach it. ``aux_head`` is never
used (an unused head: no gradient ever). ``forward(input_ids, labels)`` returns ``{"loss",
"logits"}``, as the HF Trainer and accelerate loops read it. Units: ``Experts`` (keeps nothing)
inside ``Block`` (the gate: a mapped unit), inside the root.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import fsdp_precision as fp

bf16, fp32 = torch.bfloat16, torch.float32

#: The gates kept in fp32; the rest computes in bf16 and reduces in fp32.
RULES = fp.PrecisionRules(param_dtype=bf16, reduce_dtype=fp32, rules=(fp.Glob("*.gate.weight"),))
DIM, VOCAB, EXPERTS = 16, 32, 4


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM, bias=False)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(x)))


class Experts(nn.Module):
    """The routed experts: a unit of its own that keeps nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor, choice: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero(as_tuple=True)[0]
            if idx.numel():  # an expert no token reaches does not run: no gradient
                out = out.index_add(0, idx, expert(x[idx]) * weight[idx, e, None].to(x.dtype))
        return out


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.moe = Experts()

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        weight = F.softmax(self.gate(h.to(self.gate.weight.dtype)).float(), dim=-1)
        return x + self.moe(h, ids % EXPERTS, weight)


class HashMoE(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.aux_head = nn.Linear(DIM, VOCAB, bias=False)  # never used

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        ids = input_ids.reshape(-1)
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, ids)
        logits = self.head(x).float()
        out: dict[str, torch.Tensor] = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels.reshape(-1))
        return out


def hash_moe(dtype: torch.dtype = fp32, seed: int = 0) -> HashMoE:
    """The model in ``dtype``, its values bf16-representable (so that its fp32 and bf16 copies
    hold the same numbers)."""
    torch.manual_seed(seed)
    model = HashMoE()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(bf16))
    return model.to(dtype)


def microbatches(late: int, steps: int = 1, window: int = 3, seed: int = 1) -> list[torch.Tensor]:
    """``steps * window`` microbatches of token ids (pass the rank in ``seed`` for data
    parallel shards). Expert ``late`` is reached only by the last microbatch of each window:
    the others hold no token ``t`` with ``t % EXPERTS == late``. Every other expert is reached
    by every microbatch on every rank (FSDP2 needs the same parameters to have gradients on
    every rank of a reduce-scatter)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps * window):
        ids = torch.randint(0, VOCAB, (2, 6), generator=g)
        last = i % window == window - 1
        if not last:
            hit = ids % EXPERTS == late
            ids = torch.where(hit, (ids + 1) % VOCAB, ids)  # VOCAB % EXPERTS == 0
        reached = [e for e in range(EXPERTS) if last or e != late]
        ids[0, : len(reached)] = torch.tensor(reached)
        out.append(ids)
    return out
