"""The memory model of a plan: bytes per rank before activations, with AdamW."""

from __future__ import annotations

from fsdp_precision._plan.data import PlanData

__all__ = ["memory_per_rank"]


def memory_per_rank(plan: PlanData) -> dict[str, int]:
    """Bytes per rank at ``plan.world_size``: the sharded parameters (storage dtype), their
    gradients (same size), AdamW's two fp32 moments of the trainable ones, and the peak of
    gathered units (the unit computing and the one prefetched), all with FSDP's dim-0 padding.
    """
    ws = plan.world_size
    params = sum(p.padded_numel(ws) * p.storage.itemsize for u in plan.units for p in u.params)
    trainable = sum(
        p.padded_numel(ws) for u in plan.units for p in u.params if p.reduce is not None
    )
    gathered = sorted((sum(u.gather_bytes(ws).values()) for u in plan.units), reverse=True)
    return {
        "params": params // ws,
        "grads": params // ws,
        "adamw_state": 2 * 4 * trainable // ws,
        "gathered_peak": sum(gathered[:2]),  # the unit computing and the one prefetched
    }
