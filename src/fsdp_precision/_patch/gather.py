"""``_get_param_all_gather_inputs``: one flat copy per target dtype for mapped units.

Upstream's foreach-copy fast path casts every parameter to the *first* one's ``param_dtype``.
Here a mapped unit gets one flat buffer and one ``_foreach_copy_`` per target dtype; the mixed
inputs then travel as bytes through FSDP's own uint8 all-gather path, still one all-gather per
unit. Units without mapped parameters, or with one target dtype, take torch's original.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp._fully_shard import _fsdp_collectives as _coll
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState

from fsdp_precision._patch import registry
from fsdp_precision._patch.tags import in_mapped_unit

__all__ = ["get_param_all_gather_inputs"]


def _use_foreach_copy(fsdp_param: FSDPParam) -> bool:
    # Same predicate as upstream's fast path.
    return (
        fsdp_param.param_dtype is not None
        and not fsdp_param.offload_to_cpu
        and not hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather")
    )


@torch.no_grad()
def get_param_all_gather_inputs(fsdp_params: list[FSDPParam]) -> list[list[torch.Tensor]]:
    """Upstream's foreach-copy fast path, with one flat buffer and one copy per target dtype."""
    original = registry.original(_coll, "_get_param_all_gather_inputs")
    if registry.compiled_autograd_enabled():  # 2.11: upstream's per-parameter path
        return original(fsdp_params)  # type: ignore[no-any-return]
    if not in_mapped_unit(fsdp_params[0]):
        return original(fsdp_params)  # type: ignore[no-any-return]
    fast = [_use_foreach_copy(p) for p in fsdp_params]
    if len({p.param_dtype for p, f in zip(fsdp_params, fast, strict=True) if f}) <= 1:
        return original(fsdp_params)  # type: ignore[no-any-return]
    inputs: list[list[torch.Tensor]] = [[] for _ in fsdp_params]
    by_dtype: dict[torch.dtype, tuple[list[int], list[torch.Tensor]]] = {}
    for i, fsdp_param in enumerate(fsdp_params):
        if not fast[i]:
            inputs[i] = fsdp_param.all_gather_inputs
            continue
        source = (
            fsdp_param._sharded_param_data
            if fsdp_param.sharded_state == ShardedState.SHARDED
            else fsdp_param._sharded_post_forward_param_data
        )
        assert fsdp_param.param_dtype is not None and source is not None
        indices, sources = by_dtype.setdefault(fsdp_param.param_dtype, ([], []))
        indices.append(i)
        sources.append(source)
    for dtype, (indices, sources) in by_dtype.items():
        numels = [t.numel() for t in sources]
        flat = torch.empty((sum(numels),), device=fsdp_params[indices[0]].device, dtype=dtype)
        splits = torch.split(flat, numels)
        torch._foreach_copy_(splits, sources)
        for i, split in zip(indices, splits, strict=True):
            inputs[i] = [split]
    return inputs
