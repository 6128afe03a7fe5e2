"""Routes aligned with a batch exactly as its tokens are: the engine's T - 1 rows plus the last
token, right and left padding by the attention mask, packing by cu_seqlens, truncation; every
position without a route spread over the experts (no expert gets all the padding)."""

from __future__ import annotations

import pytest
import torch

from fsdp_precision.replay import MISSING, RouteShape, RoutingReplayError, batch_routes, spread

SHAPE = RouteShape(layers=2, top_k=2, num_experts=4)


def _seq(tokens: int, base: int) -> torch.Tensor:
    """An engine's routes for a sequence of ``tokens`` tokens: ``tokens - 1`` rows, row ``r``
    of every layer holding ``(base + r) % 4`` and the next expert (distinct, identifiable)."""
    first = (torch.arange(tokens - 1) + base) % 4
    row = torch.stack([first, (first + 1) % 4], dim=-1)
    return row[:, None, :].expand(tokens - 1, 2, 2).to(torch.int16)


def _is_spread(routes: torch.Tensor) -> bool:
    return bool((routes >= 0).all() and (routes[..., 0] != routes[..., 1]).all())


def test_right_and_left_padding_place_each_sequence_on_its_tokens() -> None:
    seqs = [_seq(5, 0), _seq(3, 2)]
    right = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    left = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    for mask in (right, left):
        out = batch_routes(seqs, SHAPE, attention_mask=mask)
        assert out.shape == (2, 5, 2, 2) and out.dtype == torch.int16
        for b, seq in enumerate(seqs):
            where = mask[b].nonzero().squeeze(1)
            assert torch.equal(out[b, where[:-1]], seq)  # the engine's rows, in order
        assert _is_spread(out)
    # no mask: right padding to the longest
    assert torch.equal(batch_routes(seqs, SHAPE), batch_routes(seqs, SHAPE, attention_mask=right))


def test_packing_places_sequences_one_after_another() -> None:
    seqs = [_seq(3, 0), _seq(4, 1)]
    out = batch_routes(seqs, SHAPE, cu_seqlens=torch.tensor([0, 3, 7]))
    assert out.shape == (1, 7, 2, 2)
    assert torch.equal(out[0, 0:2], seqs[0]) and torch.equal(out[0, 3:6], seqs[1])
    assert _is_spread(out)


def test_truncation_keeps_the_rows_of_the_tokens_kept() -> None:
    seqs = [_seq(6, 0)]
    mask = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(RoutingReplayError, match="6 tokens by its routes .* holds 4 .* truncation"):
        batch_routes(seqs, SHAPE, attention_mask=mask)
    right = batch_routes(seqs, SHAPE, attention_mask=mask, truncation="right")
    assert torch.equal(right[0], seqs[0][:4])
    left = batch_routes(seqs, SHAPE, attention_mask=mask, truncation="left")
    assert torch.equal(left[0, :3], seqs[0][2:])  # the last token's row is spread


def test_routes_of_another_sequence_are_refused() -> None:
    with pytest.raises(RoutingReplayError, match="3 tokens by its routes .* holds 5 .* another"):
        batch_routes([_seq(3, 0)], SHAPE, attention_mask=torch.ones(1, 5))
    with pytest.raises(RoutingReplayError, match=r"shape \(2, 3, 2\); this model's are"):
        batch_routes([torch.zeros(2, 3, 2, dtype=torch.int16)], SHAPE)
    with pytest.raises(RoutingReplayError, match="do not bound 2 sequences"):
        batch_routes([_seq(3, 0), _seq(3, 0)], SHAPE, cu_seqlens=[0, 3])
    with pytest.raises(RoutingReplayError, match="not both"):
        batch_routes([_seq(3, 0)], SHAPE, attention_mask=torch.ones(1, 3), cu_seqlens=[0, 3])


def test_padding_is_spread_evenly_over_the_experts() -> None:
    """Negative control for miles #2697: filling padding with one expert id would send every
    pad token to that expert (its EP rank); spread, the counts differ by at most one."""
    routes = torch.full((4, 64, 2, 2), MISSING, dtype=torch.int16)
    out = spread(routes, SHAPE)
    counts = torch.bincount(out[..., 0, :].flatten().long(), minlength=4)
    assert int(counts.max() - counts.min()) <= 1
    assert _is_spread(out)
    kept = torch.zeros(1, 3, 2, 2, dtype=torch.int16)
    assert spread(kept, SHAPE) is kept  # nothing missing: unchanged
