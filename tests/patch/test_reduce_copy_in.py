"""The mixed reduce-scatter's copy-in writes dense buffers (issue 53): torch's ``chunk_cat``
takes its fused CUDA kernel only for a contiguous output, and a run's columns of the
``(world_size, n)`` send buffer are not contiguous from world size 2 on, where CUDA falls back to
padding and concatenating every gradient, in every backward. Checked on CPU through the
argument every call receives; the values are those of one ``chunk_cat`` of every gradient."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdp_precision._patch import reduce as _reduce

bf16, fp32 = torch.bfloat16, torch.float32


def gradients(world_size: int) -> list[torch.Tensor]:
    """A mixed unit's gradients in runs by dtype: bf16 bulk, then fp32 kept ones."""
    torch.manual_seed(0)
    shapes = [(2 * world_size, 3), (world_size, 5), (4 * world_size,), (world_size, 2)]
    dtypes = [bf16, bf16, fp32, fp32]
    return [torch.randn(s).to(d) for s, d in zip(shapes, dtypes, strict=True)]


@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_every_chunk_cat_writes_a_dense_buffer(
    monkeypatch: pytest.MonkeyPatch, world_size: int
) -> None:
    grads = gradients(world_size)
    columns = [g.numel() // world_size for g in grads]
    rows = torch.full((world_size, sum(columns)), float("nan"))
    real = torch.ops.fsdp.chunk_cat
    dense: list[bool] = []

    def spy(tensors: list[torch.Tensor], dim: int, num_chunks: int, out: Any) -> Any:
        dense.append(out.is_contiguous())
        return real(tensors, dim=dim, num_chunks=num_chunks, out=out)

    monkeypatch.setattr(torch.ops.fsdp, "chunk_cat", spy)
    _reduce._copy_in(grads, columns, rows, world_size)
    assert dense == [True, True]  # one call per dtype run, each into a dense buffer
    expected = torch.empty_like(rows)
    real([g.float() for g in grads], dim=0, num_chunks=world_size, out=expected)
    assert torch.equal(rows, expected)
