"""The advisor on a smaller build (``advise(model, inputs, stand_in=...)``): where the full-size
forward cannot run on the meta device (MoE dispatch reads which tokens chose which expert), a
smaller build of the same class runs on real values and its findings carry to every block and
expert of the full-size model by name. Negative controls: the meta trace alone, and a stand-in
of another class."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fsdp_precision as fp

W = 8


class _Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wi = nn.Linear(W, W, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wi(x)


class _Experts(nn.Module):
    """Experts named ``expert_0``, ``expert_1``, ... (Switch Transformers' names)."""

    def __init__(self, count: int) -> None:
        super().__init__()
        for i in range(count):
            self.add_module(f"expert_{i}", _Expert())

    def __getitem__(self, i: int) -> _Expert:
        module = getattr(self, f"expert_{i}")
        assert isinstance(module, _Expert)
        return module


class _MoeBlock(nn.Module):
    """Top-1 routing dispatched with ``nonzero``: the meta device cannot say how many tokens
    chose an expert."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.count = experts
        self.router = nn.Linear(W, experts, bias=False)
        self.experts = _Experts(experts)
        self.norm = nn.LayerNorm(W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        choice = self.router(h).softmax(-1).argmax(-1)
        out = torch.zeros_like(h)
        for i in range(self.count):
            rows = (choice == i).nonzero().flatten()
            out[rows] = self.experts[i](h[rows])
        return x + out


class _Moe(nn.Module):
    def __init__(self, blocks: int, experts: int) -> None:
        super().__init__()
        self.embed = nn.Linear(W, W)
        self.blocks = nn.ModuleList(_MoeBlock(experts) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return h


def _meta(blocks: int = 6, experts: int = 8) -> _Moe:
    with torch.device("meta"):
        return _Moe(blocks, experts)


def _small() -> _Moe:
    torch.manual_seed(0)
    return _Moe(2, 2)


def _inputs() -> torch.Tensor:
    return torch.randn(64, W, generator=torch.Generator().manual_seed(0))


def test_on_meta_the_dispatch_stops_the_trace_at_the_first_block() -> None:
    alone = fp.advise(_meta(), _inputs())  # the negative control
    assert not alone.complete and "nonzero" in alone.stopped
    assert alone.params(["router"]) == {"blocks.0.router.weight"}  # the other five: unseen
    assert "blocks.*.experts.expert_7.wi" in alone.not_reached


def test_the_stand_in_finds_every_router_of_the_full_size_model() -> None:
    model = _meta()
    advice = fp.advise(model, _inputs(), stand_in=_small())
    assert advice.complete and advice.stopped == ""
    assert "of a smaller build" in advice.traced
    assert advice.params(["router"]) == {f"blocks.{i}.router.weight" for i in range(6)}
    assert advice.rules() == (fp.Glob("*.router.weight"),)
    # Experts 2..7 exist only in the full-size model: their numbered siblings carry them.
    names = {n for n, _ in model.named_parameters()}
    assert advice.not_reached == ()
    assert "blocks.5.experts.expert_7.wi.weight" in names
    assert advice.params(["norm"]) >= {f"blocks.{i}.norm.weight" for i in range(6)}


def test_a_plan_uses_the_advice_it_is_given_and_traces_nothing() -> None:
    model = _meta()
    advice = fp.advise(model, _inputs(), stand_in=_small())
    calls: list[str] = []
    model.register_forward_pre_hook(lambda *_: calls.append("forward"))
    rules = fp.PrecisionRules(param_dtype=torch.bfloat16, advice="apply")
    plan = fp.compile_param_dtype_maps(model, rules, [*model.blocks, model], advice=advice)
    assert calls == []  # the model's own forward never ran (it would stop on meta)
    kept = {fqn for fqn, p in plan.params_by_fqn.items() if p.compute == torch.float32}
    assert kept == {f"blocks.{i}.router.weight" for i in range(6)}


def test_a_stand_in_of_another_class_is_refused() -> None:
    class Other(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([_MoeBlock(2)])

    with pytest.raises(ValueError, match="stand_in is a Other, the model a _Moe"):
        fp.advise(_meta(), _inputs(), stand_in=Other())


class _TwoGates(nn.Module):
    """Block 0's ``gate`` is a projection, block 1's a router: one globbed name, two
    verdicts."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.gates = nn.ModuleList(nn.Linear(W, W, bias=False) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, gate in enumerate(self.gates):
            if i % 2:
                _, top = gate(x).softmax(-1).topk(1, dim=-1)
                x = x + top.float()
            else:
                x = x + gate(x)
        return x


def test_two_verdicts_under_one_name_keep_the_stronger() -> None:
    with torch.device("meta"):
        model = _TwoGates(4)
    advice = fp.advise(model, torch.randn(3, W), stand_in=_TwoGates(2))
    # Over-keeping a projection costs memory; a router left in bf16 costs precision.
    assert advice.params(["router"]) == {f"gates.{i}.weight" for i in range(4)}
