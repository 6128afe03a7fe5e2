"""The precision advisor (``fsdp_precision.advise``, ``PrecisionRules(advice=...)``): what the
traced forward sees decides, never a name. Every model here names its parameters ``p0``,
``p1``, ...: a kind found is found from the ops alone. Each kind has a negative control, a model
that uses the same parameter without the op that makes it sensitive."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import fsdp_precision as fp
from fsdp_precision import ParamDtypeMapError
from fsdp_precision.testing import GatherProbe

from tests.support.models import bf16, fp32

W = 8


class Anonymous(nn.Module):
    """Parameters named ``p0``, ``p1``, ... with the shapes given; ``forward`` is ``fn``."""

    def __init__(self, fn: Callable[..., torch.Tensor], *shapes: tuple[int, ...]) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for i, shape in enumerate(shapes):
            self.register_parameter(f"p{i}", nn.Parameter(torch.randn(shape, generator=g)))
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self, x)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _routed(m: Anonymous, x: torch.Tensor) -> torch.Tensor:
    scores = F.linear(x, m.p0).softmax(-1)
    weights, _ = scores.topk(2, dim=-1)
    return F.linear(x, m.p1) * weights.sum(-1, keepdim=True)


def _topk_then_sigmoid(m: Anonymous, x: torch.Tensor) -> torch.Tensor:
    values, _ = F.linear(x, m.p0).topk(1, dim=-1)
    return F.linear(x, m.p1) * torch.sigmoid(values)


def _attention(m: Anonymous, x: torch.Tensor) -> torch.Tensor:
    q, k = F.linear(x, m.p0), F.linear(x, m.p1)
    return (q @ k.transpose(-1, -2)).softmax(-1) @ x


def _biased_selection(m: Anonymous, x: torch.Tensor) -> torch.Tensor:
    scores = torch.sigmoid(F.linear(x, m.p0))
    _, idx = (scores + m.p1).topk(2, dim=-1)  # a bias on the scores decides the choice too
    return x * scores.gather(-1, idx).sum(-1, keepdim=True)


def _log_space(m: Anonymous, x: torch.Tensor) -> torch.Tensor:
    return x * -torch.exp(m.p0.float())


def _softplus_bias(m: Anonymous, x: torch.Tensor) -> torch.Tensor:
    return x * F.softplus(F.linear(x, m.p0) + m.p1)


def _softplus_mlp(m: Anonymous, x: torch.Tensor) -> torch.Tensor:
    return F.linear(F.softplus(F.linear(x, m.p0)), m.p1)


def _gains(m: Anonymous, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, m.p2) * m.p0 + x * m.p1[None, :]


def _glu(m: Anonymous, x: torch.Tensor) -> torch.Tensor:
    return F.silu(F.linear(x, m.p0)) * F.linear(x, m.p1)


def _norms(m: Anonymous, x: torch.Tensor) -> torch.Tensor:
    h = m.p0 * _rms(x)
    return F.linear(F.layer_norm(h, (W,), m.p1, m.p2), m.p3)


def _sinusoidal(m: Anonymous, x: torch.Tensor) -> torch.Tensor:
    t = x[:, :1] * 100.0  # a "timestep" computed from the input
    freqs = torch.exp(-torch.arange(W // 2, dtype=torch.float32))
    features = torch.cat([torch.sin(t * freqs), torch.cos(t * freqs)], dim=-1)
    embedding = F.linear(F.silu(F.linear(features, m.p0, m.p1)), m.p2)
    return F.linear(x, m.p3) + embedding


#: (model, parameter shapes, expected kind per parameter; absent: not flagged)
CASES = {
    "router: linear, softmax, topk": (_routed, [(4, W), (W, W)], {"p0": "router"}),
    "router: topk first, then sigmoid": (_topk_then_sigmoid, [(4, W), (W, W)], {"p0": "router"}),
    "router bias added to the scores": (
        _biased_selection,
        [(4, W), (4,)],
        {"p0": "router", "p1": "router"},
    ),
    "no selection: attention's softmax": (_attention, [(W, W), (W, W)], {}),
    "log-space: exp of the parameter": (_log_space, [(W,)], {"p0": "log_space"}),
    "log-space: softplus of a bias": (_softplus_bias, [(W, W), (W,)], {"p1": "log_space"}),
    "no log-space: softplus after a projection": (_softplus_mlp, [(W, W), (W, W)], {}),
    "gains: a scalar and a per-channel scale": (
        _gains,
        [(), (W,), (W, W)],
        {"p0": "gain", "p1": "gain"},
    ),
    "no gain: a gated MLP multiplies projections": (_glu, [(W, W), (W, W)], {}),
    "norms: a manual RMSNorm and layer_norm": (
        _norms,
        [(W,), (W,), (W,), (W, W)],
        {"p0": "norm", "p1": "norm", "p2": "norm"},
    ),
    "sinusoidal: the timestep MLP, not the token projection": (
        _sinusoidal,
        [(W, W), (W,), (W, W), (W, W)],
        {"p0": "sinusoidal", "p1": "sinusoidal", "p2": "sinusoidal"},
    ),
}


def _kinds(advice: fp.PrecisionAdvice) -> dict[str, str]:
    return {p: a.kind for a in advice.advice for p in a.params}


@pytest.mark.parametrize("case", CASES)
def test_the_trace_finds_each_kind_from_the_ops_alone(case: str) -> None:
    fn, shapes, expected = CASES[case]
    model = Anonymous(fn, *shapes)
    advice = fp.advise(model, torch.randn(3, W))
    assert advice.covered and "stopped early" not in advice.traced
    assert _kinds(advice) == expected
    for a in advice.advice:  # each says what it saw, and where
        assert " in <root> (Anonymous): " in a.reason, a.reason


def test_the_same_on_the_meta_device() -> None:
    fn, shapes, expected = CASES["router: linear, softmax, topk"]
    with torch.device("meta"):
        model = Anonymous(fn, *shapes)
    advice = fp.advise(model, torch.randn(3, W))
    assert _kinds(advice) == expected


def test_reasons_name_the_ops_and_the_module() -> None:
    advice = fp.advise(Anonymous(_routed, (4, W), (W, W)), torch.randn(3, W))
    (router,) = advice.advice
    assert router.reason.startswith("linear -> softmax -> topk in <root> (Anonymous): its scores")
    assert router.rule == 'Glob("p0")' and router.params == ("p0",)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(W, 4, bias=False)
        self.proj = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, _ = self.gate(x).softmax(-1).topk(2, dim=-1)
        return x + self.proj(x) * weights.sum(-1, keepdim=True)


class _Stack(nn.Module):
    """Two blocks whose router is ``blocks.i.gate``: the rule globs the block index."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_one_ready_rule_per_kind_over_the_blocks() -> None:
    advice = fp.advise(_Stack(), torch.randn(3, W))
    (router,) = advice.advice
    assert router.rule == 'Glob("*.gate.weight")'
    assert router.params == ("blocks.0.gate.weight", "blocks.1.gate.weight")
    assert advice.rules() == (fp.Glob("*.gate.weight"),)


class _ScaledNorm(nn.LayerNorm):
    """A LayerNorm that also holds a projection's weight, read by ``linear`` (not a norm's)."""

    def __init__(self) -> None:
        super().__init__(W)
        self.extra = nn.Parameter(torch.randn(W, W))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(super().forward(x), self.extra)


class _NormBlock(nn.Module):
    def __init__(self, norm: type[nn.Module]) -> None:
        super().__init__()
        self.ln = norm() if norm is _ScaledNorm else nn.LayerNorm(W)
        self.proj = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.ln(x))


class _NormStack(nn.Module):
    """Blocks with a LayerNorm (weight and bias) before a biased projection, and a final norm."""

    def __init__(self, norm: type[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_NormBlock(norm) for _ in range(2))
        self.final = nn.LayerNorm(W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.final(x)


def test_a_norms_weight_and_bias_are_one_rule_and_one_candidate() -> None:
    """A LayerNorm's weight and bias: one glob over the module (what a user writes), measured
    once with both kept (the emulation keeps a module whole), its bytes both parameters'."""
    advice = fp.advise(_NormStack(nn.LayerNorm), [torch.randn(3, W)], measure=True)
    assert {a.rule: a.params for a in advice.advice} == {
        'Glob("*.ln.*")': ("blocks.0.ln.weight", "blocks.0.ln.bias", "blocks.1.ln.weight", "blocks.1.ln.bias"),
        'Glob("final.*")': ("final.weight", "final.bias"),
    }  # fmt: skip
    assert advice.measured is not None
    figures = {f.candidate.pattern: f for f in advice.measured.figures}
    assert sorted(figures) == ["*.ln.*", "final.*"]
    assert figures["final.*"].bytes_kept == 2 * W * 2  # two fp32 vectors over their bf16 size


def test_a_module_glob_that_would_keep_another_parameter_is_not_used() -> None:
    """The negative control: where the norm module also holds a parameter the trace read
    without flagging, the module glob would keep it too; weight and bias stay two rules."""
    advice = fp.advise(_NormStack(_ScaledNorm), torch.randn(3, W))
    rules = {a.rule for a in advice.advice}
    assert 'Glob("*.ln.weight")' in rules and 'Glob("*.ln.bias")' in rules, rules
    assert not any("extra" in p for a in advice.advice for p in a.params)


class _Stops(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(W, W)
        self.second = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        raise RuntimeError("a forward this input cannot run")
        return self.second(h)  # pragma: no cover


def test_a_trace_that_stops_says_what_it_did_not_reach() -> None:
    advice = fp.advise(_Stops(), torch.randn(3, W))
    assert "stopped early: RuntimeError: a forward this input cannot run" in advice.traced
    assert advice.covered and advice.not_reached == ("second",)
    assert "not covered (the trace did not reach them): second" in advice.explain()


def test_no_inputs_is_not_covered_and_never_silently_empty() -> None:
    advice = fp.advise(Anonymous(_routed, (4, W), (W, W)))  # no dummy_inputs
    assert not advice.covered and advice.advice == ()
    assert "not covered: no parameter was reached" in advice.explain()
    rules = fp.PrecisionRules(advice="apply")
    with pytest.raises(ParamDtypeMapError, match=r'advice="apply"\) needs a traced forward'):
        fp.compile_param_dtype_maps(Anonymous(_routed, (4, W), (W, W)), rules)


@pytest.mark.parametrize("mode", ["bogus", "APPLY", None])
def test_an_unknown_advice_mode_is_refused(mode: object) -> None:
    with pytest.raises(ValueError, match=r"PrecisionRules.advice is .*; use one of 'report'"):
        fp.PrecisionRules(advice=mode)  # type: ignore[arg-type]


# ----------------------------------------------------------------------- the plan


def _plan(advice: str, *rules: fp.Glob) -> fp.PrecisionPlan:
    model = _Stack()
    return fp.compile_param_dtype_maps(
        model,
        fp.PrecisionRules(rules=rules, advice=advice),  # type: ignore[arg-type]
        [*model.blocks, model],
        example_inputs=torch.randn(3, W),
    )


def test_report_lists_what_computes_low_and_changes_nothing() -> None:
    plan = _plan("report")
    assert all(p.compute == bf16 for u in plan.units for p in u.params)
    assert plan.advice is not None and plan.advice.params() == {
        "blocks.0.gate.weight",
        "blocks.1.gate.weight",
    }
    text = plan.explain()
    assert 'router       2 params  Glob("*.gate.weight")' in text
    assert plan.to_dict()["advice"]["advice"][0]["rule"] == 'Glob("*.gate.weight")'


def test_apply_keeps_them_with_a_rule_explain_shows() -> None:
    plan = _plan("apply")
    kept = {p.fqn: p.compute for u in plan.units for p in u.params if p.compute == fp32}
    assert kept == {"blocks.0.gate.weight": fp32, "blocks.1.gate.weight": fp32}
    assert "advice (router) '*.gate.weight': 2 parameters" in plan.explain()
    assert plan.advice is not None and plan.advice.advice == ()  # nothing left computing low
    assert plan.module_casts  # the kept routers get their boundary casts


def test_user_rules_come_first_and_off_traces_nothing() -> None:
    plan = _plan("report", fp.Glob("*.gate.weight"))
    assert plan.advice is not None and plan.advice.advice == ()  # already fp32
    off = _plan("off")
    assert off.advice is None and "precision advice" not in off.explain()


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("advice", ["apply", "report"])
def test_applied_advice_trains_with_the_routers_gathered_in_fp32(advice: str) -> None:
    plan = _plan(advice)
    model = plan.apply()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(3, W)
    with GatherProbe(model) as probe:
        model(x).sum().backward()
    opt.step()
    gates = {n: t.dtype for n, t in probe.seen.items() if ".gate." in n}
    assert len(gates) == 2
    # negative control: with advice="report" the routers compute in bf16
    assert set(gates.values()) == ({fp32} if advice == "apply" else {bf16})
    assert all(t.dtype == bf16 for n, t in probe.seen.items() if ".gate." not in n)


@pytest.mark.usefixtures("world1")
def test_model_policy_applies_the_advice_to_a_transformers_moe() -> None:
    pytest.importorskip("transformers", reason="transformers is not installed")
    from tests.support import load_script

    model = load_script("scripts/screen_hf_keep.py").build("qwen3_moe")
    policy = fp.model_policy(model, fp.PrecisionRules(advice="apply"))
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    with GatherProbe(model) as probe:
        model(input_ids=torch.randint(0, 100, (2, 8))).logits.float().sum().backward()
    gates = {n: t.dtype for n, t in probe.seen.items() if n.endswith("mlp.gate.weight")}
    assert len(gates) == 2 and set(gates.values()) == {fp32}
    assert {t.dtype for n, t in probe.seen.items() if n not in gates} == {bf16}


def test_the_trace_changes_nothing_of_the_model() -> None:
    # train mode kept (bitsandbytes' CPU layers repack at an eval forward without gradients),
    # but running statistics untouched: batch norms run in eval mode during the trace
    model = nn.Sequential(nn.Linear(W, W), nn.BatchNorm1d(W), nn.Linear(W, 4)).train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    seen: list[bool] = []
    model[0].register_forward_hook(lambda m, a, o: seen.append(m.training))
    fp.advise(model, torch.randn(3, W))
    assert seen == [True] and model.training and model[1].training
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_timestep_feature_rules_cast_their_outputs_back_and_router_rules_do_not() -> None:
    """A kept timestep-feature Linear returns activations for the bf16 layers after it; a
    router's fp32 logits go to softmax and top-k in fp32 (the diffusion screen's HunyuanVideo,
    CogVideoX, QwenImage and UNet failed their first forward with both at ``"auto"``)."""
    from fsdp_precision._advise.advice import Advice, PrecisionAdvice, advised_rules

    advice = PrecisionAdvice(
        (
            Advice("router", "*.mlp.gate.weight", ("l.0.mlp.gate.weight",), "r"),
            Advice("sinusoidal", "*.linear_1.*", ("t.linear_1.weight",), "s"),
        ),
        traced="test",
        covered=True,
    )
    assert [(g.pattern, g.boundary) for g in advice.rules()] == [
        ("*.mlp.gate.weight", "auto"),
        ("*.linear_1.*", "inputs_outputs"),
    ]
    assert [(r.kind, r.boundary) for r in advised_rules(advice)] == [
        ("router", "auto"),
        ("sinusoidal", "inputs_outputs"),
    ]
    assert advice.advice[1].rule == 'Glob("*.linear_1.*", boundary="inputs_outputs")'
