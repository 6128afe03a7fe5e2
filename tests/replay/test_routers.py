"""Which routers replay drives, found by what a router is (its class, its expert count and
top-k, its decoder layer), and everything else refused by name before anything changes."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fsdp_precision._replay.routers import REFUSED, find_routers, router_class
from fsdp_precision.replay import RouteShape, RoutingReplay, RoutingReplayError


class ToyRouter(nn.Module):
    def __init__(self, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.num_experts, self.top_k = experts, top_k
        self.weight = nn.Parameter(torch.randn(experts, 8))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = hidden.reshape(-1, 8) @ self.weight.T
        probs = logits.softmax(-1)
        values, ids = probs.topk(self.top_k, dim=-1)
        return logits, values, ids


class Layer(nn.Module):
    def __init__(self, router: nn.Module | None) -> None:
        super().__init__()
        self.mlp = nn.Module()
        if router is not None:
            self.mlp.gate = router


def decoder(*routers: nn.Module | None) -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList(Layer(r) for r in routers)
    return model


def test_routers_are_found_with_their_absolute_decoder_index() -> None:
    model = nn.Module()
    model.model = decoder(None, ToyRouter(), None, ToyRouter())
    routers, shape = find_routers(model)
    assert [(r.fqn, r.layer) for r in routers] == [
        ("model.layers.1.mlp.gate", 1),
        ("model.layers.3.mlp.gate", 3),
    ]
    assert shape == RouteShape(layers=4, top_k=2, num_experts=4)


class PhimoeTopKRouter(ToyRouter):
    """Named as transformers' Phimoe router, which replay refuses."""


def _two() -> nn.Module:
    model = decoder(ToyRouter())
    model.layers[0].attn_gate = ToyRouter()
    return model


def _forwards(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if "forward" in vars(m)]


REFUSALS = {
    "cannot drive 'layers.1.mlp.gate' \\(PhimoeTopKRouter\\): its sparsemixer": lambda: decoder(
        ToyRouter(), PhimoeTopKRouter()
    ),
    "'gate' \\(ToyRouter\\) is not in a decoder layer": lambda: nn.ModuleDict(
        {"gate": ToyRouter()}
    ),
    "routers sit in 2 decoders": lambda: nn.ModuleDict(
        {"thinker": decoder(ToyRouter()), "talker": decoder(ToyRouter())}
    ),
    "routers disagree on their experts or top-k": lambda: decoder(ToyRouter(4), ToyRouter(8)),
    "'layers.0.mlp.gate' and 'layers.0.attn_gate' both sit in decoder layer 0": lambda: _two(),
    "Module has no router routing replay can drive": lambda: decoder(None, None),
}


@pytest.mark.parametrize("message", REFUSALS)
def test_what_replay_cannot_drive_is_refused_by_name_and_nothing_changes(message: str) -> None:
    model = REFUSALS[message]()
    with pytest.raises(RoutingReplayError, match=message):
        RoutingReplay(model)
    assert _forwards(model) == []  # no router was wrapped


def test_every_refusal_says_why() -> None:
    assert all(reason and not reason.endswith(".") for reason in REFUSED.values())


def test_a_router_fully_shard_wrapped_is_still_its_own_class() -> None:
    """FSDP2 swaps in a subclass (``FSDPToyRouter``); families are keyed by the model's class."""
    fsdp_like = type("FSDPToyRouter", (ToyRouter,), {"__module__": "torch.distributed.fsdp._x"})
    assert router_class(fsdp_like()) is ToyRouter


def test_a_router_that_selects_twice_is_refused_at_its_first_forward() -> None:
    class TwiceRouter(ToyRouter):
        def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
            logits, values, ids = super().forward(hidden)
            return logits, values, logits.topk(self.top_k, dim=-1)[1] + 0 * ids

    model = decoder(TwiceRouter())
    replay = RoutingReplay(model)
    with (
        replay.routes(torch.zeros(3, 1, 2, dtype=torch.int16)),
        pytest.raises(RoutingReplayError, match="called topk over its 4 experts 2 times"),
    ):
        model.layers[0].mlp.gate(torch.randn(3, 8))
