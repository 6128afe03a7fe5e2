"""The measured advice (``advise(model, batches, measure=True)``): each figure against the same
figure computed by hand, the model left as it was, memory bounded to one module's copy, and the
refusals. The models name their parameters ``p0``, ``p1``: nothing here reads a name."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fsdp_precision as fp
from fsdp_precision._advise.emulate import Computing

from tests.support.models import bf16, fp32

pytestmark = pytest.mark.fast

W, E, K = 16, 8, 2


class Router(nn.Module):
    """Logits, softmax and top-k in one module (Qwen3-MoE's ``TopKRouter``)."""

    def __init__(self) -> None:
        super().__init__()
        self.p0 = nn.Parameter(torch.randn(E, W, generator=torch.Generator().manual_seed(1)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.linear(x, self.p0).softmax(-1, dtype=torch.float)
        weights, chosen = probs.topk(K, dim=-1)
        return weights.to(x.dtype), chosen


class Block(nn.Module):
    """A norm, a router, two experts mixed by the routing weights."""

    def __init__(self, gate_in_parent: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.norm = nn.LayerNorm(W)
        self.gate_in_parent = gate_in_parent
        self.router = nn.Linear(W, E, bias=False) if gate_in_parent else Router()
        self.experts = nn.Parameter(torch.randn(E, W, W, generator=g) / W**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.gate_in_parent:  # the gate returns logits, the block selects
            weights, chosen = self.router(h).softmax(-1, dtype=torch.float).topk(K, dim=-1)
            weights = weights.to(h.dtype)
        else:
            weights, chosen = self.router(h)
        out = torch.einsum("bti,btkio->btko", h, self.experts[chosen].transpose(-1, -2))
        return x + (out * weights.unsqueeze(-1)).sum(-2)


class Net(nn.Module):
    def __init__(self, gate_in_parent: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(12, W)
        self.block = Block(gate_in_parent)
        self.head = nn.Linear(W, 32, bias=False)

    def forward(self, x: torch.Tensor) -> Any:
        return SimpleNamespace(logits=self.head(self.block(self.embed(x))))


def _batches(count: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(8, 64, 12, generator=g) for _ in range(count)]


def _router_inputs(net: Net, x: torch.Tensor) -> torch.Tensor:
    """What the router receives in the stored-precision forward."""
    with torch.no_grad():
        return net.block.norm(net.embed(x))


def _hand_flips(net: Net, batches: list[torch.Tensor]) -> tuple[int, int]:
    """Tokens whose top-k set differs between the router in bf16 and kept, on the same inputs
    (rounded to bf16, as a bf16 model hands them over)."""
    flipped = total = 0
    weight = net.block.router.weight if net.block.gate_in_parent else net.block.router.p0
    for ids in batches:
        x = _router_inputs(net, ids).to(bf16)
        low = F.linear(x, weight.to(bf16)).softmax(-1, dtype=torch.float).topk(K, dim=-1)[1]
        kept = F.linear(x.float(), weight).softmax(-1, dtype=torch.float).topk(K, dim=-1)[1]
        differ = (low.sort(-1).values != kept.sort(-1).values).any(-1)
        flipped += int(differ.sum())
        total += differ.numel()
    return flipped, total


def _figures(advice: fp.PrecisionAdvice, kind: str) -> Any:
    assert advice.measured is not None
    return next(f for f in advice.measured.figures if f.candidate.kind == kind)


@pytest.mark.parametrize("gate_in_parent", [False, True], ids=["router_selects", "block_selects"])
def test_router_flips_are_the_hand_count(gate_in_parent: bool) -> None:
    """The share of tokens whose expert set changes is exactly the hand count, whether the
    router module selects or the module above it does (the trace's selection site)."""
    net = Net(gate_in_parent)
    batches = _batches()
    flipped, total = _hand_flips(net, batches)
    assert flipped > 0, "the fixture must have close top-k decisions"
    router = _figures(fp.advise(net, batches, measure=True), "router")
    (only,) = router.routers
    assert only.tokens == total
    assert only.flips == pytest.approx(flipped / total, abs=0)
    assert only.weight_error > 0
    site = "block" if gate_in_parent else "block.router"
    assert only.module == site


def test_a_module_error_is_the_hand_relative_error() -> None:
    """A norm's output error is ``||norm_bf16(x) - norm_kept(x)|| / ||norm_kept(x)||`` on its
    own inputs rounded to bf16, averaged over batches."""
    net = Net()
    with torch.no_grad():
        net.block.norm.weight.copy_(1 + 0.37 * torch.randn(W))
    batches = _batches()
    errors = []
    for ids in batches:
        with torch.no_grad():
            x = net.embed(ids).to(bf16)  # the norm's input, rounded as a bf16 model hands it
            norm = net.block.norm
            low = F.layer_norm(x, (W,), norm.weight.to(bf16), norm.bias.to(bf16))
            kept = F.layer_norm(x.float(), (W,), norm.weight, norm.bias)
        errors.append(float((low.float() - kept).norm() / kept.norm()))
    norm_figures = _figures(fp.advise(net, batches, measure=True), "norm")
    assert norm_figures.module_error == pytest.approx(sum(errors) / len(errors), rel=1e-6)
    assert norm_figures.module_error_max == pytest.approx(max(errors), rel=1e-6)


def test_the_uniform_end_is_the_model_cast_to_bf16() -> None:
    """With nothing kept, the logits are those of the model cast whole to bf16 (each module's
    inputs cast as a unit root's are), and the KL and argmax flips are theirs."""
    net = Net()
    batches = _batches()
    advice = fp.advise(net, batches, measure=True)
    low = Net().to(bf16)
    kl = flips = rows = 0.0
    with torch.no_grad():
        for ids in batches:
            ref = F.log_softmax(net(ids).logits.float().reshape(-1, 32), -1)
            got = F.log_softmax(low(ids.to(bf16)).logits.float().reshape(-1, 32), -1)
            kl += float(F.kl_div(got, ref, log_target=True, reduction="sum"))
            flips += float((ref.argmax(-1) != got.argmax(-1)).sum())
            rows += ref.shape[0]
    assert advice.measured is not None
    uniform = advice.measured.uniform
    assert uniform.kl == pytest.approx(kl / rows, rel=1e-6)
    assert uniform.argmax_flips == pytest.approx(flips / rows, abs=0)
    assert uniform.kl > 0


def test_everything_kept_is_the_stored_precision_exactly() -> None:
    """Matrices kept whole return their outputs in fp32 (boundary auto): with every parameter
    of a model of matrices kept, its output is the stored-precision one, bit for bit; with
    none kept it is not (the negative control)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    kept = {n: "auto" for n, _ in net.named_parameters()}
    with torch.no_grad():
        reference = net(x)
        with Computing(net, bf16, kept):  # type: ignore[arg-type]
            assert torch.equal(net(x), reference)
        with Computing(net, bf16, {}):
            low = net(x)
    assert low.dtype == bf16 and not torch.equal(low.float(), reference)


def test_the_model_is_left_as_it_was_and_memory_holds_one_module_copy() -> None:
    """After measuring: every parameter the same tensor, bitwise, in its dtype; the modes and
    hooks as they were. During the uniform forward, the low-precision copies alive at once
    never exceed the parameters of one module and the modules around it (the model is never
    duplicated)."""
    net = Net()
    net.train()
    before = {n: (p, p.detach().clone()) for n, p in net.named_parameters()}
    hooks = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in net.modules()]
    fp.advise(net, _batches(), measure=True)
    for name, (param, value) in before.items():
        now = net.get_parameter(name)
        assert now is param and now.dtype == fp32 and torch.equal(now, value), name
    assert net.training and all(m.training for m in net.modules())
    assert hooks == [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in net.modules()]

    emulation = Computing(net, bf16, {})
    peak = [0]

    def watch(module: nn.Module, args: Any) -> None:
        alive = sum(original.numel() for _, original, _ in emulation._swaps.kept.values())
        peak[0] = max(peak[0], alive)

    own = {n: sum(p.numel() for p in m.parameters(recurse=False)) for n, m in net.named_modules()}
    largest = max(sum(c for a, c in own.items() if n.startswith(a)) for n in own)
    with torch.no_grad(), emulation:
        handles = [m.register_forward_pre_hook(watch) for m in net.modules()]
        net(_batches(1)[0])
        for handle in handles:
            handle.remove()
    whole = sum(p.numel() for p in net.parameters())
    assert 0 < peak[0] <= largest < whole


def test_measured_advice_keeps_what_measures_above_the_threshold() -> None:
    """``advice="measured"``: at threshold 0 every candidate with a positive effect is kept,
    ranked by effect per byte; at threshold 1 none (no candidate removes all of bf16's KL)."""
    net = Net()
    batches = _batches()
    advice = fp.advise(net, batches, measure=True)
    assert advice.measured is not None
    positive = {f.candidate.pattern for f in advice.measured.figures if f.effect >= 0}
    assert positive, "some candidate must help in this fixture"
    assert {a.pattern for a in advice.kept_by_measure(0.0)} == positive
    assert advice.kept_by_measure(1.0) == ()
    for threshold, expected in ((0.0, positive), (1.0, set())):
        rules = fp.PrecisionRules(advice="measured", advice_threshold=threshold)
        plan = fp.compile_param_dtype_maps(net, rules, [net], example_inputs=batches)
        kept = {n for u in plan.units for n in u.param_dtype_map}
        wanted = {p for a in advice.advice if a.pattern in expected for p in a.params}
        assert kept == wanted, (threshold, kept)
        assert all(p.dtype == fp32 for p in net.parameters())  # planning changed nothing


def test_explain_and_to_dict_show_the_figures() -> None:
    net = Net()
    advice = fp.advise(net, _batches(), measure=True)
    text = advice.explain()
    assert "router block.router: experts change for" in text
    assert "at the end, bfloat16 uniform: logits KL" in text
    data = advice.to_dict()["measured"]
    assert data["figures"][0]["routers"][0]["module"] == "block.router"
    assert set(data["ranked"]) == {a.pattern for a in advice.advice}


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: Net().to(bf16), "stored in bfloat16: load it in float32"),
        (lambda: Net().to("meta"), "meta device"),
    ],
    ids=["stored_in_bf16", "on_meta"],
)
def test_what_cannot_be_measured_is_refused_before_anything_runs(build: Any, match: str) -> None:
    net = build()
    before = [(p.dtype, p.device) for p in net.parameters()]
    with pytest.raises(ValueError, match=match):
        fp.advise(net, _batches(1), measure=True)
    assert before == [(p.dtype, p.device) for p in net.parameters()]


def test_a_stand_in_is_traced_never_measured() -> None:
    with pytest.raises(ValueError, match="measures the model itself"):
        fp.advise(Net(), _batches(1), measure=True, stand_in=Net())


@pytest.mark.parametrize("threshold", [-0.1, 1.5, "5%", True])
def test_a_bad_threshold_is_refused(threshold: object) -> None:
    with pytest.raises(ValueError, match="advice_threshold"):
        fp.PrecisionRules(advice="measured", advice_threshold=threshold)  # type: ignore[arg-type]
