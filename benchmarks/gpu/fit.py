"""How many decoder layers fit the device: sizes chosen from its free memory, never assumed.

A timed case keeps at least two variants resident at a time (the reference and one variant,
``--layout pairs``), each with fp32 master weights and AdamW's two moments (12 bytes a
parameter; gradients are transient). The pair's states may take at most ``share`` of the free
memory; the rest is left for one step's activations, gradients and the allocator. Parameters
grow linearly with the layers (embeddings and head, then the same block repeated), so two meta
builds give the count at any depth.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

STATE_BYTES_PER_PARAM = 12  # fp32 weights + AdamW's exp_avg and exp_avg_sq
#: Share of the free memory a resident pair's states may take.
SHARE = 0.6
RESIDENT = 2  # the reference and one variant


def layers_that_fit(
    params_at: Callable[[int], int], layers: int, free_bytes: int, *, share: float = SHARE
) -> tuple[int, dict[str, Any]]:
    """The most layers, at most ``layers``, whose resident pair's states fit in ``share`` of
    ``free_bytes`` (``params_at(n)``: the parameters with ``n`` layers); 0 when not even one
    does. Returns the layers and the record of the decision."""
    base = params_at(1)
    per_layer = params_at(2) - base
    budget = free_bytes * share

    def pair_bytes(n: int) -> int:
        return RESIDENT * STATE_BYTES_PER_PARAM * (base + (n - 1) * per_layer)

    chosen = layers
    while chosen > 0 and pair_bytes(chosen) > budget:
        chosen -= 1
    return chosen, {
        "free_bytes": free_bytes,
        "share": share,
        "asked_layers": layers,
        "layers": chosen,
        "params": base + (chosen - 1) * per_layer if chosen else 0,
        "pair_state_bytes": pair_bytes(chosen) if chosen else 0,
        "asked_pair_state_bytes": pair_bytes(layers),
        "rule": f"{RESIDENT} resident copies x {STATE_BYTES_PER_PARAM} B/parameter <= "
        f"{share:.0%} of the free memory",
    }
