"""Replay in one process: the experts get the engine's ids, the weights and the gate's gradient
are the live router's dense probabilities at those ids (checked against a hand-written MoE),
recompute under activation checkpointing replays the same routes, compiled graphs follow new
routes, and nothing falls back to live routing silently."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers", reason="transformers is not installed")

from fsdp_precision.replay import RoutingReplay, RoutingReplayError  # noqa: E402

from tests.replay import support  # noqa: E402


def test_replaying_the_live_routes_is_the_live_forward_bitwise() -> None:
    net = support.model()
    ids = support.batch()
    live = net(ids).logits
    routes = support.live_routes(net, ids)
    replay = RoutingReplay(net)
    with replay.routes(routes):
        replayed = net(ids).logits
    assert torch.equal(replayed, live)


def test_every_router_and_its_experts_use_the_given_ids() -> None:
    net = support.model()
    ids = support.batch()
    routes = support.other_routes(support.live_routes(net, ids))
    got_by_experts: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(net.model.layers):
        if i:
            layer.mlp.experts.register_forward_hook(
                lambda m, args, out, i=i: got_by_experts.__setitem__(i, args[1])
            )
    replay = RoutingReplay(net)
    with replay.routes(routes):
        seen = support.picked(net, lambda: net(ids))
    for layer, (picked,) in seen.items():
        expected = routes[:, :, layer].reshape(-1, support.TOP_K).long()
        assert torch.equal(picked, expected)
        assert torch.equal(got_by_experts[layer], expected)


def test_weights_and_gate_gradient_are_the_dense_probabilities_at_the_replayed_ids() -> None:
    """The sparse block under replay against a hand-written Qwen3-MoE block: softmax over every
    expert, gathered at the replayed ids, renormalised; ids the live router would not pick
    (shifted routes) still get their probability, and their gate rows a gradient."""
    net = support.model()
    block = net.model.layers[1].mlp
    hidden = torch.randn(10, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        live = block.gate(hidden)[2]
    routes = ((live + 3) % support.EXPERTS).reshape(10, 1, support.TOP_K)
    full = torch.zeros(10, support.LAYERS, support.TOP_K, dtype=torch.int16)
    full[:, 1] = routes[:, 0].to(torch.int16)
    replay = RoutingReplay(net)
    with replay.routes(full):
        out = block(hidden[None])[0]
        out.square().sum().backward()
    grad = block.gate.weight.grad.clone()

    weight = block.gate.weight.detach().clone().requires_grad_()
    chosen = routes[:, 0]
    probs = F.softmax(hidden @ weight.T, dim=-1, dtype=torch.float)
    w = probs.gather(1, chosen)
    w = w / w.sum(-1, keepdim=True)
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    expected = torch.zeros_like(hidden)
    for t in range(10):
        for j in range(support.TOP_K):
            e = int(chosen[t, j])
            g, u = (gate_up[e] @ hidden[t]).chunk(2)
            expected[t] += w[t, j] * (down[e] @ (F.silu(g) * u))
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, weight.grad, rtol=1e-4, atol=1e-6)
    drifted = chosen != live  # ids the live router would not pick
    assert drifted.any() and bool((w[drifted] > 0).all()), "a drifted id lost its weight"


def _grads(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


def test_recompute_under_activation_checkpointing_replays_the_same_routes() -> None:
    ids = support.batch()
    plain = support.model()
    routes = support.other_routes(support.live_routes(plain, ids))
    replay = RoutingReplay(plain)
    with replay.routes(routes):
        plain(ids, labels=ids).loss.backward()

    ckpt = support.model()
    ckpt.activation_checkpointing_enable({"use_reentrant": False})
    replay = RoutingReplay(ckpt)
    with replay.routes(routes):
        seen = support.picked(ckpt, lambda: ckpt(ids, labels=ids).loss.backward())
    for layer, calls in seen.items():
        assert len(calls) == 2, "the router did not run again in backward's recompute"
        expected = routes[:, :, layer].reshape(-1, support.TOP_K).long()
        assert all(torch.equal(c, expected) for c in calls)
    expected_grads, got = _grads(plain), _grads(ckpt)
    assert expected_grads.keys() == got.keys()
    for name, grad in expected_grads.items():
        assert torch.equal(got[name], grad), name


def test_recompute_with_the_routes_cleared_raises_instead_of_routing_live() -> None:
    """Negative control: backward outside the routes' block under checkpointing would have
    recomputed with live routes (other experts than the forward's); it raises."""
    ids = support.batch()
    net = support.model()
    routes = support.other_routes(support.live_routes(net, ids))
    net.activation_checkpointing_enable({"use_reentrant": False})
    replay = RoutingReplay(net)
    with replay.routes(routes):
        loss = net(ids, labels=ids).loss
    with pytest.raises(RoutingReplayError, match="ran with routing replay attached and no routes"):
        loss.backward()


def test_a_compiled_model_follows_new_routes() -> None:
    """Compiled (dynamo traces the wrapped router and its top-k answer), the model gives the
    eager replay's logits for each of two route sets in turn: the graph reads the routes set,
    not those it was traced with."""
    ids = support.batch()
    net = support.model()
    live_routes = support.live_routes(net, ids)
    shifted = support.other_routes(live_routes)
    replay = RoutingReplay(net)
    eager = {}
    for name, routes in (("live", live_routes), ("shifted", shifted)):
        with replay.routes(routes), torch.no_grad():
            eager[name] = net(ids).logits
    assert not torch.equal(eager["live"], eager["shifted"])
    compiled = torch.compile(net, backend="aot_eager")
    for name, routes in (("live", live_routes), ("shifted", shifted), ("live", live_routes)):
        with replay.routes(routes), torch.no_grad():
            torch.testing.assert_close(compiled(ids).logits, eager[name], rtol=0, atol=0)


def test_routes_for_another_batch_or_model_are_refused() -> None:
    net = support.model()
    replay = RoutingReplay(net)
    ids = support.batch()
    cases = {
        "saw 12 tokens and the routes set hold 10": torch.zeros(10, 3, 2, dtype=torch.int16),
        r"do not fit this model: expected \[batch, seq, 3, 2\]": torch.zeros(2, 6, 4, 2).long(),
        "must hold integer expert ids": torch.zeros(2, 6, 3, 2),
    }
    for message, routes in cases.items():
        with pytest.raises(RoutingReplayError, match=message):
            replay.set(routes)
            net(ids)
    replay.clear()
    with pytest.raises(RoutingReplayError, match="no routes set"):
        net(ids)
    with replay.live():
        net(ids)  # live routing where asked


def test_remove_gives_the_routers_their_own_forward_back() -> None:
    net = support.model()
    ids = support.batch()
    live = net(ids).logits
    replay = RoutingReplay(net)
    replay.remove()
    assert all("forward" not in vars(g) for g in support.routers(net).values())
    assert torch.equal(net(ids).logits, live)


def test_explain_names_every_router_by_decoder_layer_and_the_memory() -> None:
    replay = RoutingReplay(support.model())
    text = replay.explain()
    assert "2 routers, 3 decoder layers, top-2 of 8 experts" in text
    assert "12 bytes per token" in text
    assert "layer   1: model.layers.1.mlp.gate (Qwen3MoeTopKRouter)" in text
    assert replay.shape.bytes_per_token() == 2 * 3 * 2


def test_remove_keeps_a_forward_another_wrapper_set_before() -> None:
    net = support.model()
    gate = net.model.layers[1].mlp.gate
    theirs = gate.forward  # e.g. another library's instance-level wrapper
    gate.forward = theirs
    replay = RoutingReplay(net)
    replay.remove()
    assert vars(gate)["forward"] is theirs
    replay.remove()  # twice: nothing more to give back
    assert vars(gate)["forward"] is theirs
