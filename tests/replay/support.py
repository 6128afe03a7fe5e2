"""What the replay tests share: a tiny Qwen3-MoE with a dense first layer, and the routes its
routers pick live (captured from the indices each router returns)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from tests.support.hf_models import tiny_qwen3_moe

#: A dense first layer (its rows unused), two MoE layers, top-2 of 8 experts.
CONFIG: dict[str, Any] = {"num_hidden_layers": 3, "mlp_only_layers": [0], "num_experts": 8}
LAYERS, TOP_K, EXPERTS = 3, 2, 8


def model(seed: int = 0, **overrides: Any) -> nn.Module:
    """The tiny Qwen3-MoE (fp32, top-k probabilities renormalised), in train mode."""
    return tiny_qwen3_moe(seed=seed, **{**CONFIG, "norm_topk_prob": True, **overrides}).train()


def batch(seed: int = 1, shape: tuple[int, int] = (2, 6)) -> torch.Tensor:
    return torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(seed))


def routers(net: nn.Module) -> dict[int, nn.Module]:
    """Each MoE layer's router, by decoder index."""
    return {i: layer.mlp.gate for i, layer in enumerate(net.model.layers) if i not in (0,)}


def picked(net: nn.Module, run: Any) -> dict[int, list[torch.Tensor]]:
    """The indices each router returned in every call ``run()`` made (forward and recompute)."""
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in routers(net)}
    hooks = [
        gate.register_forward_hook(lambda m, a, out, i=i: seen[i].append(out[2].detach()))
        for i, gate in routers(net).items()
    ]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def live_routes(net: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``[batch, seq, layers, top_k]`` int16: what ``net`` routes ``ids`` to, live (dense
    layers' rows zero, as the engines give them)."""
    with torch.no_grad():
        seen = picked(net, lambda: net(ids))
    routes = torch.zeros(*ids.shape, LAYERS, TOP_K, dtype=torch.int16)
    for layer, (ids_of_layer,) in seen.items():
        routes[:, :, layer] = ids_of_layer.reshape(*ids.shape, TOP_K).to(torch.int16)
    return routes


def other_routes(routes: torch.Tensor, shift: int = 3) -> torch.Tensor:
    """``routes`` moved to other experts (distinct per token still)."""
    return ((routes.long() + shift) % EXPERTS).to(torch.int16)
