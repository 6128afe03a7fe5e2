"""Align sequences' routes with a batch exactly as their tokens are aligned.

One sequence of ``T`` tokens has ``T - 1`` rows from the engine (:mod:`.formats`); its last
token gets a row with no route. Sequences are then placed where the batch holds their tokens:
at the positions an ``attention_mask`` marks (right or left padding alike), or one after
another at ``cu_seqlens`` (packing), truncated as the tokens were. Every position without a route
(padding, the last token, a row the engine left at -1) gets ids spread over the experts
(position ``p`` picks ``p * top_k + j mod num_experts``), so no expert, and no rank of expert
parallelism, receives all the padding (miles #2697: one expert's rank ran out of memory).

The result is a ``[batch, seq, layers, top_k]`` int16 tensor whose first two dimensions are the
batch's: slice it as the tokens are sliced (a context-parallel shard, a shift) and it stays
aligned; torch's ``context_parallel`` takes it as one more buffer with sequence dimension 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from fsdp_precision._base.errors import RoutingReplayError
from fsdp_precision._replay.formats import MISSING
from fsdp_precision._replay.routers import RouteShape

__all__ = ["batch_routes", "spread"]

Truncation = Literal["error", "left", "right"]


def batch_routes(
    sequences: Sequence[torch.Tensor],
    shape: RouteShape,
    *,
    attention_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    truncation: Truncation = "error",
) -> torch.Tensor:
    """The routes of a batch, ``[batch, seq, layers, top_k]`` int16.

    Args:
        sequences: One entry per sequence of the batch, in order: its engine routes
            ``[tokens - 1, layers, top_k]`` (:func:`from_vllm`, :func:`from_sglang`).
        shape: The model's routes (``RoutingReplay.shape``).
        attention_mask: ``[batch, seq]``: sequence ``b``'s tokens are where row ``b`` is
            non-zero, in order (right or left padding). Without it and without ``cu_seqlens``,
            sequences are right-padded to the longest.
        cu_seqlens: Packing: sequence ``i``'s tokens are ``cu_seqlens[i]:cu_seqlens[i + 1]`` of
            one row (``[1, cu_seqlens[-1], layers, top_k]``).
        truncation: Where a sequence has fewer places than tokens: ``"error"`` (default),
            or the side its tokens were cut from (``"right"`` keeps the first ones).
    """
    if truncation not in ("error", "left", "right"):
        raise RoutingReplayError(
            f"truncation={truncation!r} is not one of 'error', 'left', 'right'"
        )
    if attention_mask is not None and cu_seqlens is not None:
        raise RoutingReplayError(
            "give attention_mask (a padded batch) or cu_seqlens (a packed one), not both"
        )
    rows = [_with_last_token(s, shape, i) for i, s in enumerate(sequences)]
    if cu_seqlens is not None:
        bounds = _bounds(cu_seqlens, len(rows))
        out = torch.full((1, bounds[-1], shape.layers, shape.top_k), MISSING, dtype=torch.int16)
        for i, seq in enumerate(rows):
            out[0, bounds[i] : bounds[i + 1]] = _fit(seq, bounds[i + 1] - bounds[i], i, truncation)
    else:
        if attention_mask is None:
            width = max((len(r) for r in rows), default=0)
            mask = torch.zeros(len(rows), width, dtype=torch.bool)
            for i, seq in enumerate(rows):
                mask[i, : len(seq)] = True
        else:
            mask = attention_mask.detach().to("cpu").bool()
            if mask.dim() != 2 or mask.shape[0] != len(rows):
                raise RoutingReplayError(
                    f"attention_mask of shape {tuple(mask.shape)} does not hold {len(rows)} "
                    "sequences as [batch, seq]"
                )
        batch, width = mask.shape
        out = torch.full((batch, width, shape.layers, shape.top_k), MISSING, dtype=torch.int16)
        for i, seq in enumerate(rows):
            where = mask[i].nonzero().squeeze(1)
            out[i, where] = _fit(seq, len(where), i, truncation)
    return spread(out, shape)


def spread(routes: torch.Tensor, shape: RouteShape) -> torch.Tensor:
    """``routes`` with every ``(token, layer)`` that holds a -1 given ids spread over the
    experts by token position (distinct within a token where ``top_k <= num_experts``)."""
    missing = (routes == MISSING).any(dim=-1, keepdim=True)
    if not bool(missing.any()):
        return routes
    tokens = torch.arange(routes[..., 0, 0].numel()).reshape(routes.shape[:-2])
    picks = (tokens[..., None] * shape.top_k + torch.arange(shape.top_k)) % shape.num_experts
    filled = picks[..., None, :].expand(routes.shape).to(routes.dtype)
    return torch.where(missing, filled, routes)


def _with_last_token(seq: torch.Tensor, shape: RouteShape, index: int) -> torch.Tensor:
    if seq.dim() != 3 or tuple(seq.shape[1:]) != (shape.layers, shape.top_k):
        raise RoutingReplayError(
            f"sequence {index}'s routes have shape {tuple(seq.shape)}; this model's are "
            f"[tokens - 1, {shape.layers}, {shape.top_k}]"
        )
    last = torch.full((1, shape.layers, shape.top_k), MISSING, dtype=torch.int16)
    return torch.cat([seq.to(torch.int16), last])


def _fit(seq: torch.Tensor, places: int, index: int, truncation: Truncation) -> torch.Tensor:
    tokens = len(seq)
    if places == tokens:
        return seq
    if places < tokens and truncation != "error":
        return seq[:places] if truncation == "right" else seq[tokens - places :]
    raise RoutingReplayError(
        f"sequence {index} has {tokens} tokens by its routes ({tokens - 1} engine rows + the "
        f"last token) and the batch holds {places} of its tokens: "
        + (
            "pass truncation='right' or 'left' as its tokens were truncated"
            if places < tokens
            else "these routes belong to another sequence (the engine routes prompt + "
            "completion, all but the last token)"
        )
    )


def _bounds(cu_seqlens: torch.Tensor | Sequence[int], count: int) -> list[int]:
    bounds = [int(b) for b in cu_seqlens]
    if (
        len(bounds) != count + 1
        or bounds[0] != 0
        or any(b > a for a, b in zip(bounds[1:], bounds, strict=False))
    ):
        raise RoutingReplayError(
            f"cu_seqlens {bounds} do not bound {count} sequences: expected {count + 1} "
            "non-decreasing offsets from 0"
        )
    return bounds
