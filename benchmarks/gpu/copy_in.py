"""The mixed reduce-scatter's copy-in at the multi-rank layout, on one device.

At world size 1 FSDP2 issues no reduce-scatter and the patch's copy-in never runs, so a one-GPU
run cannot see it through training. Here it runs directly, on one decoder layer's gradients
(bf16 bulk, fp32 kept router and norms) laid out for ``world_size`` ranks: the library's copy-in
(every ``chunk_cat`` into a dense buffer) against the earlier one (a dtype run's ``chunk_cat``
into its column slice of the send buffer, which is not contiguous from 2 ranks on, where CUDA
leaves its fused kernel). Paired and interleaved; both must give the same bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from fsdp_precision._patch import reduce as _reduce

BF16, FP32 = torch.bfloat16, torch.float32


def sliced_copy_in(
    grads: list[torch.Tensor], columns: list[int], rows: torch.Tensor, world_size: int
) -> None:
    """The copy-in before issue 53: each run's chunk_cat writes its column slice directly."""
    column = 0
    for start, stop in _reduce._runs([g.dtype for g in grads]):
        width = sum(columns[start:stop])
        run = [g for g in grads[start:stop] if g.numel()]
        if run:
            out = rows if width == rows.size(1) else rows[:, column : column + width]
            torch.ops.fsdp.chunk_cat(run, dim=0, num_chunks=world_size, out=out)
        column += width


def layer_gradients(
    sizes: dict[str, Any], world_size: int, device: torch.device
) -> list[torch.Tensor]:
    """One Qwen3-MoE decoder layer's gradients in the dtypes a kept unit computes them in, dim 0
    padded to a multiple of ``world_size`` as FSDP pads it: the bulk bf16, router and norms
    fp32."""
    h, e, m = sizes["hidden_size"], sizes["num_experts"], sizes["moe_intermediate_size"]
    q = sizes["num_attention_heads"] * sizes["head_dim"]
    kv = sizes["num_key_value_heads"] * sizes["head_dim"]

    def pad(n: int) -> int:
        return -(-n // world_size) * world_size

    bulk = [(q, h), (kv, h), (kv, h), (h, q), (e, 2 * m, h), (e, h, m)]
    kept = [(e, h), (h,), (h,), (sizes["head_dim"],), (sizes["head_dim"],)]
    out = [torch.randn((pad(s[0]), *s[1:]), device=device).to(BF16) for s in bulk]
    return out + [torch.randn((pad(s[0]), *s[1:]), device=device) for s in kept]


def timed(fn: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(
    sizes: dict[str, Any],
    device: torch.device,
    *,
    world_size: int,
    iters: int,
    deadline: float,
    stats: Callable[[list[float], list[float], float | None], dict[str, Any]],
) -> dict[str, Any]:
    """Time both copy-ins on one layer's gradients; the JSON case record."""
    grads = layer_gradients(sizes, world_size, device)
    columns = [g.numel() // world_size for g in grads]
    rows = {k: torch.empty((world_size, sum(columns)), dtype=FP32, device=device) for k in "ds"}
    dense = lambda: _reduce._copy_in(grads, columns, rows["d"], world_size)  # noqa: E731
    sliced = lambda: sliced_copy_in(grads, columns, rows["s"], world_size)  # noqa: E731
    for fn in (dense, sliced):  # warm-up
        fn()
    same = bool(torch.equal(rows["d"], rows["s"]))
    times: dict[str, list[float]] = {"dense": [], "sliced": []}
    for i in range(iters):
        order = [("dense", dense), ("sliced", sliced)]
        for name, fn in order if i % 2 == 0 else order[::-1]:
            times[name].append(timed(fn, device))
        if time.perf_counter() > deadline and i + 1 >= 6:
            break
    nbytes = rows["d"].numel() * rows["d"].element_size()
    return {
        "status": "ok",
        "world_size_layout": world_size,
        "buffer_bytes": nbytes,
        "gradients": len(grads),
        "dense_equals_sliced": same,
        "median_s": {k: sorted(v)[len(v) // 2] for k, v in times.items()},
        "ratios": {"dense_over_sliced": stats(times["dense"], times["sliced"], None)},
    }
