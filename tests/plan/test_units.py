"""Units torch can run: parameter uses, the wrap policies, 0-dim parameters, the plan checked
before the first fully_shard. The architecture screen is tests/train/test_screen.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_precision import (
    DistributedConfig,
    Glob,
    ParamDtypeMapError,
    PrecisionRules,
    auto_wrap_units,
    compile_param_dtype_maps,
    plan_model_for_training,
    wrap_model_for_training,
)
from fsdp_precision._advise.usage import ParamUsage, param_usage
from fsdp_precision._plan.units import choose_units

from tests.support.harness import collect_cases, distributed_suite

bf16, fp32 = torch.bfloat16, torch.float32

# ---------------------------------------------------------------------- models


class Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(x))


class LanguageModel(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(dim) for _ in range(2))

    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            inputs_embeds = layer(inputs_embeds)
        return inputs_embeds


class Outer(nn.Module):
    """LLaVA's pattern: the outer model embeds the tokens with the language model's embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = LanguageModel()
        self.head = nn.Linear(16, 4)

    def get_input_embeddings(self) -> nn.Module:
        return self.lm.embed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.lm(self.get_input_embeddings()(ids)))


class DtypeReader(nn.Module):
    """SmolVLM's pattern: the outer forward casts its input to ``self.dtype``, the dtype of the
    first floating parameter, which lives in ``body``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    @property
    def dtype(self) -> torch.dtype:
        return next(p.dtype for p in self.parameters() if p.is_floating_point())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(self.dtype)
        return self.head(self.body(h) + h)


class HiddenDtypeReader(nn.Module):
    """The same read without the text ``self.dtype``: only a traced forward sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(next(self.body.parameters()).dtype)
        return self.head(self.body(h) + h)


class WithScalar(nn.Module):
    """CLIP's pattern: a 0-dim ``logit_scale`` beside ordinary layers."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(16) for _ in range(2))
        self.logit_scale = nn.Parameter(torch.tensor(2.6592))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x * self.logit_scale.exp()


def ids(step: int = 0) -> torch.Tensor:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(step * 7 + rank))


def feats(step: int = 0) -> torch.Tensor:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(step * 7 + rank))


def unit_names(model: nn.Module, units: list[nn.Module] | tuple[nn.Module, ...]) -> list[str]:
    names = {id(m): n or "<root>" for n, m in model.named_modules()}
    return [names[id(u)] for u in units]


NO_USES = ParamUsage({}, "none")

# ---------------------------------------------------------------------- uses decide units

#: (model factory, threshold, example inputs, expected units, refused module, the parameter named,
#:  units when the uses are ignored: the negative control)
USE_CASES = [
    pytest.param(
        Outer, 900, None, ["<root>"], "lm", "lm.embed.weight", ["lm", "<root>"], id="outer-embed"
    ),
    pytest.param(
        Outer, 900, (ids(),), ["<root>"], "lm", "lm.embed.weight", ["lm", "<root>"], id="traced"
    ),
    pytest.param(
        DtypeReader, 0, None, ["head", "<root>"], "body", "body.weight",
        ["body", "head", "<root>"], id="self-dtype-static",
    ),
    pytest.param(
        HiddenDtypeReader, 0, (feats(),), ["head", "<root>"], "body", "body.weight",
        ["body", "head", "<root>"], id="dtype-read-traced",
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("factory", "threshold", "inputs", "expected", "refused", "param", "unaware"), USE_CASES
)
def test_modules_used_outside_their_forward_are_not_units(
    factory, threshold, inputs, expected, refused, param, unaware
) -> None:
    model = factory()
    usage = param_usage(model, inputs)
    choice = choose_units(model, min_params=threshold, usage=usage)
    assert unit_names(model, choice.units) == expected
    skipped = {s.module: s.reason for s in choice.skipped}
    assert refused in skipped and repr(param) in skipped[refused], skipped
    # Negative control: without the uses the same policy picks the unit torch cannot run.
    blind = choose_units(model, min_params=threshold, usage=NO_USES)
    assert unit_names(model, blind.units) == unaware


def test_explain_says_why_a_module_is_not_a_unit() -> None:
    plan = plan_model_for_training(Outer(), DistributedConfig(fsdp_auto_wrap_min_params=900))
    text = plan.explain()
    assert "not units (selected by the wrap policy; torch could not run them as units):" in text
    assert (
        "    lm: its parameter 'lm.embed.weight' is used outside its forward, where it would "
        "still be sharded: calls get_input_embeddings() in the forward of <root>" in text
    )
    assert plan.to_dict()["not_units"][0]["module"] == "lm"


def test_hidden_dtype_read_needs_a_traced_forward() -> None:
    """Without inputs (no dummy_inputs) only static facts apply: the documented limit."""
    model = HiddenDtypeReader()
    assert "no forward traced" in param_usage(model).traced
    assert unit_names(model, auto_wrap_units(model, 0)) == ["body", "head", "<root>"]
    traced = auto_wrap_units(model, 0, example_inputs=(feats(),))
    assert unit_names(model, traced) == ["head", "<root>"]


def test_the_trace_leaves_the_model_and_the_rng_as_they_were() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 4))
    model.train()
    model[2].eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    usage = param_usage(model, (feats(),))
    assert usage.uses["0.weight"][0].source == "traced forward"
    assert torch.equal(torch.get_rng_state(), rng)
    assert [m.training for m in model] == [True, True, False]
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_failing_trace_keeps_what_it_saw() -> None:
    class Breaks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.a(x)
            raise RuntimeError("data-dependent branch")

    usage = param_usage(Breaks(), (feats(),))
    assert "stopped early: RuntimeError: data-dependent branch" in usage.traced
    assert "a.weight" in usage.uses and "b.weight" not in usage.uses


def test_the_trace_runs_on_the_meta_device() -> None:
    with torch.device("meta"):
        model = Outer()
    usage = param_usage(model, (torch.zeros(2, 6, dtype=torch.long),))
    assert usage.traced == "traced a forward on example_inputs"
    assert unit_names(model, choose_units(model, min_params=900, usage=usage).units) == ["<root>"]


# ---------------------------------------------------------------------- transformer blocks


def tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def test_transformer_block_policy_makes_each_declared_block_a_unit() -> None:
    model = tiny_llama()
    config = DistributedConfig(fsdp_auto_wrap_policy="transformer_block")
    plan = plan_model_for_training(model, config)
    assert [u.name for u in plan.units] == ["model.layers.0", "model.layers.1", "<root>"]
    named = DistributedConfig(
        fsdp_auto_wrap_policy="transformer_block",
        fsdp_transformer_block_classes=("LlamaDecoderLayer", "LlamaRMSNorm"),
    )
    names = [u.name for u in plan_model_for_training(model, named).units]
    assert names == ["model.layers.0", "model.layers.1", "model.norm", "<root>"]


BAD_BLOCKS = [
    (
        "tiny_llama",
        ("LlamaDecoderLayr",),
        r"fsdp_transformer_block_classes names 'LlamaDecoderLayr', which no module of "
        r"LlamaForCausalLM is \(did you mean 'LlamaDecoderLayer'\?\)",
    ),
    (
        "outer",
        (),
        r"fsdp_auto_wrap_policy='transformer_block': Outer declares no _no_split_modules; name "
        r"the block classes in fsdp_transformer_block_classes",
    ),
]


@pytest.mark.parametrize(("factory", "blocks", "message"), BAD_BLOCKS)
def test_transformer_block_policy_refuses_unknown_blocks(factory, blocks, message) -> None:
    model = tiny_llama() if factory == "tiny_llama" else Outer()
    config = DistributedConfig(
        fsdp_auto_wrap_policy="transformer_block", fsdp_transformer_block_classes=blocks
    )
    with pytest.raises(ValueError, match=message):
        plan_model_for_training(model, config)


def test_choose_units_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"min_params must be >= 0, got -1"):
        choose_units(Outer(), min_params=-1, usage=NO_USES)
    with pytest.raises(ValueError, match=r"policy is 'blocks'; use 'size' or 'transformer_block'"):
        choose_units(Outer(), min_params=0, policy="blocks", usage=NO_USES)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- 0-dim parameters


def test_scalars_are_replicated_in_no_unit() -> None:
    plan = plan_model_for_training(WithScalar(), DistributedConfig(fsdp_auto_wrap_min_params=0))
    assert [p.fqn for p in plan.replicated] == ["logit_scale"]
    assert plan.replicated[0].compute == fp32  # its storage dtype, not the bf16 default
    assert all(p.fqn != "logit_scale" for u in plan.units for p in u.params)
    assert plan.totals()["all_reduces_per_step"] == 1
    assert "logit_scale" in plan.explain() and plan.to_dict()["replicated"][0]["trainable"]


def test_a_rule_cannot_recast_a_replicated_scalar() -> None:
    model = WithScalar()  # fp32 storage; the rule asks the replicated scalar for bf16
    rules = PrecisionRules(
        param_dtype=fp32, reduce_dtype=fp32, rules=(Glob("logit_scale", torch.bfloat16),)
    )
    with pytest.raises(ParamDtypeMapError, match=r"0-dim parameter 'logit_scale' is replicated"):
        compile_param_dtype_maps(model, rules)


# ---------------------------------------------------------------------- two ranks


def _dtensors(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if isinstance(p, DTensor)]


def _train(model: nn.Module, make: object, steps: int = 2) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        loss = model(make(step)).float().pow(2).mean()  # type: ignore[operator]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def case_scalar_gradients_are_averaged_like_ddp() -> None:
    torch.manual_seed(0)
    reference = WithScalar()
    model = wrap_model_for_training(
        copy.deepcopy(reference),
        DistributedConfig(fsdp_mixed_precision="fp32", fsdp_auto_wrap_min_params=0),
    )
    assert not isinstance(model.logit_scale, DTensor) and len(_dtensors(model)) == 4
    model(feats()).pow(2).mean().backward()
    # Every rank's own gradient of the unsharded model, averaged: what DDP would hold.
    reference(feats()).pow(2).mean().backward()
    grads = [torch.zeros(()) for _ in range(dist.get_world_size())]
    dist.all_gather(grads, reference.logit_scale.grad.detach())
    expected = torch.stack(grads).sum() / dist.get_world_size()
    assert torch.allclose(model.logit_scale.grad, expected, rtol=1e-6), (
        model.logit_scale.grad,
        expected,
    )
    # Negative control: the same scalar merely ignored by FSDP keeps each rank's own gradient.
    assert not torch.allclose(grads[0], grads[1])


def case_scalar_models_train() -> None:
    torch.manual_seed(0)
    model = wrap_model_for_training(WithScalar(), DistributedConfig(fsdp_auto_wrap_min_params=0))
    losses = _train(model, feats)
    values = [torch.zeros(()) for _ in range(dist.get_world_size())]
    dist.all_gather(values, model.logit_scale.detach())
    assert all(torch.equal(v, values[0]) for v in values), values  # replicas stay in step
    assert all(map(torch.isfinite, map(torch.tensor, losses)))


def case_refused_plan_leaves_the_model_untouched() -> None:
    torch.manual_seed(0)
    model = Outer()
    rules = PrecisionRules(param_dtype=bf16, reduce_dtype=fp32, rules=(Glob("head.weight"),))
    plan = compile_param_dtype_maps(model, rules, [model.lm.layers[0], model.lm.layers[1], model])
    # ignored_params takes the kept head.weight away from the root call: the root's map key
    # names a parameter that call will not manage, which only the last call would find.
    with pytest.raises(ParamDtypeMapError, match=r"'head.weight' names a parameter"):
        plan.apply(ignored_params={model.head.weight})
    assert _dtensors(model) == []
    # Negative control: the same calls made one by one leave the first units sharded.
    from torch.distributed.fsdp import fully_shard

    with pytest.raises(ParamDtypeMapError):
        for unit in plan.units:
            fully_shard(unit.modules[0], mp_policy=unit.policy, ignored_params={model.head.weight})
    assert _dtensors(model) == ["lm.layers.0.proj.weight", "lm.layers.0.proj.bias"] + [
        "lm.layers.1.proj.weight",
        "lm.layers.1.proj.bias",
    ]


def case_outer_embedding_call_trains() -> None:
    torch.manual_seed(0)
    model = wrap_model_for_training(Outer(), DistributedConfig(fsdp_auto_wrap_min_params=900))
    assert all(map(lambda x: x == x, _train(model, ids)))
    # Negative control: the unit the size rule alone would choose breaks the outer call.
    torch.manual_seed(0)
    blind = Outer()
    plan = compile_param_dtype_maps(blind, DistributedConfig().precision(), [blind.lm, blind])
    plan.apply()
    with pytest.raises(Exception, match=r"mixed torch.Tensor and DTensor"):
        blind(ids())


def case_self_dtype_read_trains() -> None:
    torch.manual_seed(0)
    model = wrap_model_for_training(DtypeReader(), DistributedConfig(fsdp_auto_wrap_min_params=0))
    _train(model, feats)
    torch.manual_seed(0)
    blind = DtypeReader()
    plan = compile_param_dtype_maps(blind, DistributedConfig().precision(), [blind.body, blind])
    plan.apply()
    with pytest.raises(RuntimeError, match=r"dtype"):  # self.dtype read fp32 in a bf16 root
        blind(feats())


def case_unit_guard_names_the_module_outside_its_unit() -> None:
    from fsdp_precision import UnitUsageError
    from fsdp_precision.testing import unit_guard, verify_parity

    torch.manual_seed(0)
    blind = Outer()
    plan = compile_param_dtype_maps(blind, DistributedConfig().precision(), [blind.lm, blind])
    plan.apply()
    with pytest.raises(
        UnitUsageError,
        match=r"parameter 'lm.embed.weight' was used \(embedding\) in the forward of lm.embed, "
        r"outside its FSDP unit \[lm\], which was not gathered",
    ):
        with unit_guard(plan):
            blind(ids())
    torch.manual_seed(0)
    reader = DtypeReader()
    plan = compile_param_dtype_maps(reader, DistributedConfig().precision(), [reader.body, reader])
    with pytest.raises(
        UnitUsageError,
        match=r"'body.weight' was used \(is_floating_point\) in the forward of <root>, outside its FSDP unit \[body\]",
    ):
        verify_parity(plan, {"x": torch.ones(4, 16)})
    # Negative control: units torch can run pass the guard, forward and backward.
    torch.manual_seed(0)
    good = Outer()
    plan = plan_model_for_training(good, DistributedConfig(fsdp_auto_wrap_min_params=0))
    plan.apply()
    with unit_guard(plan):
        good(ids()).float().pow(2).mean().backward()
        good(ids()).float().pow(2).mean().backward()


CASES = collect_cases(globals())

results, test_two_ranks = distributed_suite(2, __name__, CASES)
