"""A small decoder-only transformer with an MoE-style router: the demo's built-in model, and a
test model with what precision rules are about (RMSNorms that compute in fp32, a router that
computes in its own weight's dtype). Public through :mod:`fsdp_precision.testing`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["TinyConfig", "TinyDecoder"]


@dataclass(frozen=True, kw_only=True)
class TinyConfig:
    """Size of a :class:`TinyDecoder`.

    Attributes:
        vocab: Vocabulary size. (Default: 256)
        dim: Model width; a multiple of ``heads``. (Default: 64)
        depth: Transformer blocks. (Default: 2)
        heads: Attention heads. (Default: 4)
        experts: MoE experts per block, mixed by the router's softmax. (Default: 2)
        seq: Tokens per sequence the demo feeds. (Default: 32)
    """

    vocab: int = 256
    dim: int = 64
    depth: int = 2
    heads: int = 4
    experts: int = 2
    seq: int = 32


class RMSNorm(nn.Module):
    """Computes in fp32 whatever the weight's dtype, returns the input's dtype (as HF does)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out: torch.Tensor = (h * self.weight.float()).to(x.dtype)
        return out


class Block(nn.Module):
    """Pre-norm attention, then a softmax-routed mixture of ``experts`` MLPs."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.attn_norm = RMSNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.mlp_norm = RMSNorm(cfg.dim)
        self.router = nn.Linear(cfg.dim, cfg.experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(
                nn.Linear(cfg.dim, 2 * cfg.dim), nn.GELU(), nn.Linear(2 * cfg.dim, cfg.dim)
            )
            for _ in range(cfg.experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, -1).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        # The router runs in its own weight's dtype (fp32 when kept), like HF MoE routers.
        weights = self.router(h.to(self.router.weight.dtype)).softmax(-1).to(h.dtype)
        mixed = sum(weights[..., i : i + 1] * e(h) for i, e in enumerate(self.experts))
        out: torch.Tensor = x + mixed
        return out


class TinyDecoder(nn.Module):
    """``embed``, ``blocks`` of :class:`Block`, a final ``norm`` and ``head``: token ids in,
    logits out. Keep ``*norm.weight`` and ``*router.weight`` in fp32 inside bf16 units: their
    forwards read fp32 weights and return the activation dtype.

    >>> model = TinyDecoder(TinyConfig(dim=32, depth=1))
    >>> tuple(model(torch.zeros(2, 8, dtype=torch.long)).shape)
    (2, 8, 256)
    """

    #: Blocks are never split into smaller FSDP units (the convention transformers models use).
    _no_split_modules = ("Block",)

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``tokens`` (``(batch, seq + 1)`` ids), in fp32."""
        logits: torch.Tensor = self(tokens[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
