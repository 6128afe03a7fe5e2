"""Rules compiled to exact per-unit maps: precedence, errors, explain/JSON, Hugging Face lists."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import replace

import pytest
import torch
import torch.nn as nn

from fsdp_precision import (
    Glob,
    ModuleClass,
    ParamDtypeMapError,
    ParamDtypeMixedPrecisionPolicy,
    PrecisionRules,
    compile_param_dtype_maps,
    hf,
)

from tests.support.models import Net, bf16, clones, fp16, fp32, inputs, train_in_lockstep

transformers = pytest.importorskip("transformers")
TF_MAJOR = int(transformers.__version__.split(".")[0])


def net_units(model: Net) -> list[nn.Module]:
    return [*model.blocks, model]


def plan_of(model: nn.Module, *rules, units=None, **kw):
    return compile_param_dtype_maps(
        model,
        PrecisionRules(rules=tuple(rules), **kw),
        units if units is not None else net_units(model),
    )


def test_globs_compile_to_exact_local_keys_per_unit() -> None:
    plan = plan_of(Net(), Glob("*norm.weight"), Glob("blocks.1.gate.weight", fp16))
    maps = [u.param_dtype_map for u in plan.units]
    assert maps[0] == {"norm.weight": fp32}
    assert maps[1] == {"norm.weight": fp32, "gate.weight": fp16}
    assert maps[2] == {"norm.weight": fp32}  # the root's own final norm; blocks already claimed
    assert all(isinstance(u.policy, ParamDtypeMixedPrecisionPolicy) for u in plan.units)


def test_glob_is_anchored_and_star_crosses_dots() -> None:
    from tests.support.hf_models import wan

    model = wan()
    root_only = compile_param_dtype_maps(
        model, PrecisionRules(rules=(Glob("scale_shift_table"),), hf_keep_in_fp32=False)
    )
    claimed = root_only.rule_claims["glob 'scale_shift_table'"]
    assert claimed == ["scale_shift_table"]
    everywhere = compile_param_dtype_maps(
        model, PrecisionRules(rules=(Glob("*scale_shift_table"),), hf_keep_in_fp32=False)
    )
    assert sorted(everywhere.rule_claims["glob '*scale_shift_table'"]) == [
        "blocks.0.scale_shift_table",
        "blocks.1.scale_shift_table",
        "scale_shift_table",
    ]
    text = everywhere.explain()
    assert "blocks.0.scale_shift_table" in text and "by glob '*scale_shift_table'" in text


def test_module_class_rule_and_first_match_wins() -> None:
    plan = plan_of(
        Net(),
        Glob("*.norm.weight", fp16),  # first: claims block norm weights
        ModuleClass(nn.LayerNorm),  # then: the biases and the root norm's weight
    )
    block = plan.units[0]
    rules = {p.key: (p.compute, p.rule) for p in block.params if p.claimed}
    assert rules == {
        "norm.weight": (fp16, "glob '*.norm.weight'"),
        "norm.bias": (fp32, "class LayerNorm"),
    }
    root = {p.key: p.compute for p in plan.units[2].params if p.claimed}
    assert root == {"norm.weight": fp32, "norm.bias": fp32}


def test_module_class_restricted_to_attribute_names() -> None:
    plan = plan_of(Net(), ModuleClass(nn.LayerNorm, params=("weight",)))
    assert plan.units[0].param_dtype_map == {"norm.weight": fp32}


def test_user_rules_come_before_model_declarations() -> None:
    from tests.support.hf_models import t5

    model = t5()
    plan = compile_param_dtype_maps(
        model, PrecisionRules(param_dtype=fp16, rules=(Glob("encoder.block.0.*.wo.weight", bf16),))
    )
    claims = {p.fqn: p.rule for u in plan.units for p in u.params if p.claimed}
    assert claims["encoder.block.0.layer.1.DenseReluDense.wo.weight"] == (
        "glob 'encoder.block.0.*.wo.weight'"
    )
    assert claims["decoder.block.1.layer.2.DenseReluDense.wo.weight"] == (
        "transformers _keep_in_fp32_modules 'wo'"
    )


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        (Glob("*.nrom.weight"), r"rule glob '\*\.nrom\.weight' -> float32 matches no parameter"),
        (ModuleClass(nn.BatchNorm1d), r"rule class BatchNorm1d -> float32 matches no parameter"),
    ],
)
def test_rule_matching_nothing_is_an_error(rule, message) -> None:
    with pytest.raises(ParamDtypeMapError, match=message):
        plan_of(Net(), rule)


SHADOWED = [
    (  # same pattern, another dtype: used to share one claims entry and pass silently
        (Glob("*norm.weight"), Glob("*norm.weight", fp16)),
        r"precision rule glob '\*norm\.weight' -> float16 \(rules\[1\]\) claims no parameter: "
        r"every parameter it matches \(3, e\.g\. 'blocks\.0\.norm\.weight'\) was claimed first "
        r"by rules\[0\] glob '\*norm\.weight' -> float32 \(first match wins\)\. Remove it, or "
        r"move it before the rule\(s\) it should override",
    ),
    (  # taken by two earlier rules together
        (Glob("*norm.weight"), Glob("*norm.bias"), ModuleClass(nn.LayerNorm, bf16)),
        r"precision rule class LayerNorm -> bfloat16 \(rules\[2\]\) claims no parameter: every "
        r"parameter it matches \(6, e\.g\. 'blocks\.0\.norm\.weight'\) was claimed first by "
        r"rules\[0\] glob '\*norm\.weight' -> float32, rules\[1\] glob '\*norm\.bias' -> float32",
    ),
]


@pytest.mark.parametrize(("rules", "message"), SHADOWED)
def test_rule_fully_shadowed_by_earlier_rules_is_an_error(rules, message) -> None:
    with pytest.raises(ParamDtypeMapError, match=message):
        plan_of(Net(), *rules)


def test_partly_shadowed_rule_and_shadowed_declarations_are_precedence() -> None:
    # Negative control: a rule that keeps at least one parameter is ordinary precedence.
    norms, narrow = Glob("blocks.*norm.weight"), Glob("*norm.weight", fp16)
    plan = plan_of(Net(), norms, narrow)
    claims = {c.rule: c.fqns for c in plan.claims}
    assert claims[narrow] == ("norm.weight",)
    # A model declaration that user rules shadow is precedence too: reported, not refused.
    from tests.support.hf_models import t5

    model = t5()
    wo = Glob("*wo.weight", fp32)
    plan = compile_param_dtype_maps(model, PrecisionRules(param_dtype=fp16, rules=(wo,)))
    (decl,) = [c for c in plan.claims if c.declared]
    assert decl.fqns == () and "_keep_in_fp32_modules 'wo': 0 parameters" in plan.explain()


def test_claims_are_keyed_by_rule_identity() -> None:
    a, b = ModuleClass(nn.LayerNorm, params=("weight",)), ModuleClass(nn.LayerNorm, fp16)
    plan = plan_of(Net(), a, b)
    by_fqn = {p.fqn: p for u in plan.units for p in u.params}
    assert by_fqn["norm.weight"].claimed_by is a and by_fqn["norm.bias"].claimed_by is b
    assert by_fqn["head.weight"].claimed_by is None and not by_fqn["head.weight"].claimed
    assert [c.rule for c in plan.claims] == [a, b]
    assert plan.rule_claims == {
        "class LayerNorm ['weight']": [
            "blocks.0.norm.weight",
            "blocks.1.norm.weight",
            "norm.weight",
        ],
        "class LayerNorm": ["blocks.0.norm.bias", "blocks.1.norm.bias", "norm.bias"],
    }


def test_report_labels_tell_rules_with_the_same_pattern_apart() -> None:
    from fsdp_precision._plan.records import RuleClaims
    from fsdp_precision._plan.report import claim_labels

    a, b, c = Glob("x"), Glob("x", fp16), Glob("y")
    claims = [RuleClaims(r, (), declared=False) for r in (a, b, c, a)]
    assert [label for label, _ in claim_labels(claims)] == [
        "glob 'x' -> float32 (#0)",
        "glob 'x' -> float16",
        "glob 'y'",
        "glob 'x' -> float32 (#3)",
    ]


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        (dict(world_size=0), r"world_size must be an integer >= 1, got 0"),
        (
            dict(world_size=4, reshard_after_forward=3),
            r"reshard_after_forward must be None, True, False or an integer that divides "
            r"world_size=4 .*, got 3",
        ),
        (dict(hsdp="yes"), r"hsdp must be True or False, got 'yes'"),
    ],
)
def test_fsdp_knobs_are_validated(knobs, message) -> None:
    with pytest.raises(ValueError, match=message):
        model = Net()
        compile_param_dtype_maps(model, PrecisionRules(), net_units(model), **knobs)


def test_apply_refuses_a_mesh_the_plan_does_not_count() -> None:
    model = Net()
    plan = compile_param_dtype_maps(model, PrecisionRules(), net_units(model), hsdp=True)
    assert plan.totals()["all_reduces_per_step"] == 3
    with pytest.raises(ValueError, match=r"compiled with hsdp=True but the mesh is 1-D"):
        plan.apply()


def test_bad_rules_rejected_at_construction() -> None:
    with pytest.raises(ValueError, match=r"rules\[0\] must be a Glob or ModuleClass, got '\*norm'"):
        PrecisionRules(rules=("*norm",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Glob\('x'\)\.dtype is torch\.int8, a non-floating"):
        Glob("x", torch.int8)
    with pytest.raises(ValueError, match=r"strategy must be 'patch' or 'split', got 'both'"):
        PrecisionRules(strategy="both")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"layout must be one of 'in_unit', 'separate_units'"):
        compile_param_dtype_maps(Net(), PrecisionRules(), layout="split")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- layouts that fail closed


def test_parameters_without_a_unit() -> None:
    model = Net()
    with pytest.raises(ParamDtypeMapError, match=r"belong to no planned unit.*root module last"):
        plan_of(model, Glob("*norm.weight"), units=list(model.blocks))


class TiedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight


def test_tie_across_units() -> None:
    model = TiedHead()
    with pytest.raises(
        ParamDtypeMapError,
        match=r"tied parameter 'embed\.weight' \(also head\.weight\) spans FSDP units",
    ):
        compile_param_dtype_maps(model, PrecisionRules(), [model.head, model])
    plan = compile_param_dtype_maps(model, PrecisionRules(), [model.body, model])
    assert [p.aliases for p in plan.units[1].params] == [("head.weight",)]


def test_degraded_kept_parameter() -> None:
    from tests.support.hf_models import t5

    model = t5().to(fp16)  # .to() undoes keep-in-fp32: wo is fp16 already
    with pytest.raises(
        ParamDtypeMapError,
        match=r"'encoder\.block\.0\.layer\.1\.DenseReluDense\.wo\.weight' is kept in float32 by transformers _keep_in_fp32_modules 'wo' but is stored in float16: precision was lost",
    ):
        compile_param_dtype_maps(model, PrecisionRules(param_dtype=None))
    # The keep-aware cast is the fix.
    fixed = hf.cast_keeping_fp32(t5(), fp16)
    compile_param_dtype_maps(fixed, PrecisionRules(param_dtype=None))


@pytest.mark.usefixtures("world1")
def test_a_grouped_unit_whose_key_names_two_dtypes_resolves_by_slot() -> None:
    # blocks.0.norm is kept, blocks.1.norm is not: the grouped call's keys 'weight' and
    # 'bias' name both. The call resolves by slot, as model_policy's do (accelerate's
    # [final norm, lm_head] tail is such a call), and trains like the norms wrapped one by one.
    from fsdp_precision._policy.scope import ModelScopedPolicy

    grouped, separate = clones(Net(), 2)
    rule = Glob("blocks.0.norm.*")  # kept whole: a boundary cast on blocks.0.norm alone
    plan = plan_of(grouped, rule, units=[[b.norm for b in grouped.blocks], grouped])
    policy = plan.units[0].policy
    assert isinstance(policy, ModelScopedPolicy)
    assert dict(policy.param_dtype_map) == {
        "blocks.0.norm.weight": fp32,
        "blocks.0.norm.bias": fp32,
    }
    assert list(plan.module_casts) == ["blocks.0.norm"]
    assert plan.params_by_fqn["blocks.1.norm.weight"].compute == bf16
    other = plan_of(separate, rule, units=[*(b.norm for b in separate.blocks), separate])
    assert not isinstance(other.units[0].policy, ModelScopedPolicy)  # negative control
    plan.apply()
    other.apply()
    train_in_lockstep([grouped, separate], steps=2)
    # Keys that agree stay a plain per-key map.
    model = Net()
    plan = plan_of(model, Glob("*norm.weight"), units=[[b.norm for b in model.blocks], model])
    assert not isinstance(plan.units[0].policy, ModelScopedPolicy)
    assert plan.units[0].param_dtype_map == {"weight": fp32}


def test_reduce_dtype_required_for_mixed_units() -> None:
    with pytest.raises(
        ParamDtypeMapError,
        match=r"unit blocks\.0 computes trainable parameters in \['bfloat16', 'float32'\] but reduce_dtype is None",
    ):
        plan_of(Net(), Glob("*norm.weight"), reduce_dtype=None)


class Owned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(4, 8))
        self.extras = nn.ParameterDict(
            {"scale": nn.Parameter(torch.ones(8)), "shift": nn.Parameter(torch.zeros(8))}
        )
        self.lin = nn.Linear(8, 8)


class Nested(nn.Module):
    """A norm holding a child linear: the norm's own unit would take the child's weight too."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.norm.proj = nn.Linear(8, 8)
        self.lin = nn.Linear(8, 8)


SEPARATE_REFUSALS = [
    (
        Owned,
        (Glob("table"),),
        r"separate units cannot express this plan: kept parameter 'table' \(glob 'table' -> "
        r"float32\) sits directly on the root, which also holds \['extras\.scale', "
        r"'extras\.shift', 'lin\.weight', 'lin\.bias'\] in other dtypes",
    ),
    (
        Owned,
        (Glob("extras.scale"),),
        r"module 'extras' owns kept 'extras\.scale' \(glob 'extras\.scale' -> float32\) and "
        r"\['shift'\] in other dtypes; a unit has one param_dtype, so keep the whole module\. "
        r"Use layout='in_unit'",
    ),
    (  # kept in two dtypes inside one module
        Owned,
        (Glob("extras.scale"), Glob("extras.shift", fp16)),
        r"module 'extras' owns kept 'extras\.scale' .* and \['shift'\] in other dtypes",
    ),
    (  # new with the shared layout: a descendant that is not kept
        Nested,
        (Glob("norm.weight"), Glob("norm.bias")),
        r"module 'norm' owns kept 'norm\.weight' .* and \['proj\.weight', 'proj\.bias'\] in "
        r"other dtypes",
    ),
    (
        Owned,
        (Glob("extras.*"),),
        r"kept 'extras\.scale' sits in the container 'extras' \(ParameterDict\), which nobody "
        r"calls",
    ),
]


@pytest.mark.parametrize(("make", "rules", "message"), SEPARATE_REFUSALS)
def test_split_strategy_fail_closed_layouts(make, rules, message) -> None:
    model = make()
    with pytest.raises(ParamDtypeMapError, match=message):
        compile_param_dtype_maps(
            model, PrecisionRules(rules=rules), [model], layout="separate_units"
        )
    # The same plan under the patch: one unit, exact map; the separate-units estimate says why.
    plan = compile_param_dtype_maps(model, PrecisionRules(rules=rules), [model])
    alt = plan.alternatives()["separate_units"]
    assert alt["units"] is None and re.search(message, alt["note"])
    assert "separate units:       not possible: separate units cannot express" in plan.explain()


def test_split_strategy_kept_in_a_third_dtype_gets_that_param_dtype() -> None:
    # Was refused before separate units were one layout ("kept in float16 but stored in
    # float32"): the module now gets its own unit with param_dtype=float16. Its boundary cast
    # ("auto": fp16 is not wider than the bf16 activations, so its outputs go back to bf16)
    # is the unit's input and output casts.
    model = Owned()
    for boundary, cast_inputs, outputs in [("auto", True, bf16), ("none", False, None)]:
        plan = compile_param_dtype_maps(
            model,
            PrecisionRules(rules=(ModuleClass(nn.Linear, fp16, boundary=boundary),)),
            [model],
            layout="separate_units",
        )
        (child,) = [u for u in plan.units if u.separate_unit]
        assert child.name == "lin" and child.policy.param_dtype == fp16
        assert child.policy.cast_forward_inputs is cast_inputs
        assert child.policy.output_dtype == outputs
        assert {p.fqn: p.compute for p in child.params} == {"lin.weight": fp16, "lin.bias": fp16}
    # Stored in the kept dtype: with no boundary cast, param_dtype=None (the activation
    # boundary does not move; the caller's cast_forward_inputs is kept, and casts nothing);
    # with one, the unit casts its inputs to fp32.
    for boundary, param_dtype in [("none", None), ("auto", torch.float32)]:
        rules = PrecisionRules(rules=(ModuleClass(nn.Linear, boundary=boundary),))
        plan = compile_param_dtype_maps(model, rules, [model], layout="separate_units")
        (child,) = [u for u in plan.units if u.separate_unit]
        assert child.policy.param_dtype == param_dtype
        assert child.policy.cast_forward_inputs is True


# ---------------------------------------------------------------------- plans, explain, JSON


def test_explain_and_json_report_units_bytes_and_alternatives() -> None:
    model = Net()
    plan = compile_param_dtype_maps(
        model,
        PrecisionRules(rules=(ModuleClass(nn.LayerNorm), Glob("*gate.weight"))),
        net_units(model),
        world_size=3,
    )
    data = json.loads(plan.to_json())
    block = data["units"][0]
    assert block["name"] == "blocks.0"
    assert block["policy"]["param_dtype_map"] == {
        "norm.weight": "float32",
        "norm.bias": "float32",
        "gate.weight": "float32",
    }
    # dim-0 padding for 3 shards: norm (16 -> 18) x2, gate (4 -> 6) x 16 cols
    assert block["all_gather_bytes_by_dtype"]["float32"] == (18 + 18 + 6 * 16) * 4
    assert data["totals"] == {
        "units": 3,
        "all_gathers_per_step": 5,
        "reduce_scatters_per_step": 3,
        "all_reduces_per_step": 0,
        "all_gather_bytes_per_step": data["totals"]["all_gather_bytes_per_step"],
    }
    alt = data["alternatives"]["separate_units"]
    assert alt["units"] == 3 + 5  # norm and gate per block, the root's norm
    assert alt["all_gathers_per_step"] == 5 + 2 * 5 and alt["reduce_scatters_per_step"] == 3 + 5
    text = plan.explain()
    assert "unit blocks.0: 7 params" in text and "by class LayerNorm" in text
    assert "separate units:       15 all-gathers, 8 reduce-scatters (8 units)" in text


def test_full_size_deepseek_v3_plan_on_meta() -> None:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(DeepseekV3Config())
    rules = PrecisionRules(rules=(Glob("*norm.weight"), Glob("*.mlp.gate.weight")))
    plan = compile_param_dtype_maps(model, rules, world_size=64)
    assert len(plan.units) == 62  # 61 decoder layers and the root
    moe = plan.units[3]
    assert moe.param_dtype_map["mlp.gate.weight"] == fp32
    assert moe.param_dtype_map["input_layernorm.weight"] == fp32
    if "e_score_correction_bias" in (model._keep_in_fp32_modules_strict or ()):  # 5.x
        assert "'e_score_correction_bias': matches buffers only" in plan.explain()
    json.dumps(plan.to_dict())


# ---------------------------------------------------------------------- Hugging Face semantics


def _toy_pretrained():
    from transformers import PretrainedConfig, PreTrainedModel

    class ToyConfig(PretrainedConfig):
        model_type = "fsdp_precision_toy"

    class Toy(PreTrainedModel):
        config_class = ToyConfig
        _keep_in_fp32_modules = ["wo"]
        _keep_in_fp32_modules_strict = ["router"]

        def __init__(self, config: ToyConfig) -> None:
            super().__init__(config)
            self.word_embeddings = nn.Embedding(10, 4)
            self.wo = nn.Linear(4, 4)
            self.router = nn.Linear(4, 2)
            self.post_init()

    return Toy(ToyConfig())


def test_pattern_matching_follows_the_installed_transformers() -> None:
    """4.x matches whole dotted segments; 5.x searches the glob anywhere in the name."""
    decls = hf.keep_in_fp32_declarations(_toy_pretrained(), fp16)
    (decl,) = [d for d in decls if d.pattern == "wo"]
    if TF_MAJOR >= 5:
        assert decl.params == {"wo.weight", "wo.bias", "word_embeddings.weight"}
    else:
        assert decl.params == {"wo.weight", "wo.bias"}


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [(fp16, {"strict", "keep"}), (bf16, {"strict"}), (fp32, set())],
)
def test_which_lists_apply_at_which_dtype(dtype, expected) -> None:
    decls = hf.keep_in_fp32_declarations(_toy_pretrained(), dtype)
    kinds = {"strict" if d.source.endswith("_strict") else "keep" for d in decls}
    assert kinds == expected


def test_diffusers_keeps_at_any_low_precision_dtype() -> None:
    from tests.support.hf_models import wan

    model = wan()
    for dtype in (fp16, bf16):
        decls = {d.pattern: d for d in hf.keep_in_fp32_declarations(model, dtype)}
        assert decls["scale_shift_table"].params == {
            "scale_shift_table",
            "blocks.0.scale_shift_table",
            "blocks.1.scale_shift_table",
        }
        assert decls["norm1"].params == frozenset()  # affine-free norms match nothing
        if "rope" in decls:  # declared since diffusers 0.4x; its freqs are non-persistent
            assert decls["rope"].buffers == frozenset()  # never loaded, so never kept
            assert hf.cast_keeping_fp32(wan(), dtype).rope.freqs_cos.dtype == fp32
    assert hf.keep_in_fp32_declarations(model, fp32) == []


def test_keep_aware_cast_keeps_params_buffers_and_ties() -> None:
    from tests.support.hf_models import deepseek_v3, t5

    model = hf.cast_keeping_fp32(t5(), fp16)
    assert model.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == fp32
    assert model.shared.weight.dtype == fp16
    assert model.encoder.embed_tokens.weight is model.shared.weight  # ties survive
    ds = hf.cast_keeping_fp32(deepseek_v3(), bf16)
    if not ds._keep_in_fp32_modules_strict:
        return  # transformers 4.x declares nothing for DeepseekV3
    moe = ds.model.layers[1].mlp
    assert moe.gate.weight.dtype == fp32 and moe.gate.e_score_correction_bias.dtype == fp32
    assert ds.model.layers[1].self_attn.q_a_proj.weight.dtype == bf16
    # Negative control: a blanket .to() loses the declarations.
    assert deepseek_v3().to(bf16).model.layers[1].mlp.gate.weight.dtype == bf16


def test_aligned_loading_casts_in_a_copy_and_keeps_metadata() -> None:
    from tests.support.hf_models import t5

    model = hf.cast_keeping_fp32(t5(), fp16)
    source = t5().state_dict()  # all fp32
    source_dtypes = {k: v.dtype for k, v in source.items()}
    metadata = source._metadata
    seen = {}
    original = model.load_state_dict

    def spy(sd, strict=True):
        seen["metadata"] = getattr(sd, "_metadata", None)
        return original(sd, strict=strict)

    model.load_state_dict = spy  # type: ignore[method-assign]
    hf.load_state_dict_aligned(model, source)
    assert seen["metadata"] is metadata
    assert {k: v.dtype for k, v in source.items()} == source_dtypes  # caller's dict untouched
    wo = model.encoder.block[0].layer[1].DenseReluDense.wo.weight
    assert wo.dtype == fp32 and torch.equal(
        wo, source["encoder.block.0.layer.1.DenseReluDense.wo.weight"]
    )
    assert model.shared.weight.dtype == fp16
    assert torch.equal(model.shared.weight, source["shared.weight"].to(fp16))
    assert model.encoder.embed_tokens.weight is model.shared.weight


# ---------------------------------------------------------------------- split strategy (ws 1)


@pytest.mark.usefixtures("world1")
def test_split_strategy_matches_the_patched_plan_bitwise() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    base = Net()
    split_model, patch_model, wrong_model = clones(base, 3)
    # No boundary casts: the kept units leave the activations where FSDP puts them (the
    # boundary-cast variant: test_wrap_separate_units_trains_like_the_mapped_plan).
    rules = (ModuleClass(nn.LayerNorm, boundary="none"), Glob("*gate.weight", boundary="none"))
    split = compile_param_dtype_maps(
        split_model, PrecisionRules(rules=rules), net_units(split_model), layout="separate_units"
    )
    children = [u for u in split.units if u.separate_unit]
    assert len(children) == 5 and all(u.policy.param_dtype is None for u in children)
    assert not any(isinstance(u.policy, ParamDtypeMixedPrecisionPolicy) for u in split.units)
    patch = compile_param_dtype_maps(
        patch_model, PrecisionRules(rules=rules), net_units(patch_model)
    )
    assert split.totals()["all_gathers_per_step"] == patch.totals()["all_gathers_per_step"] + 10
    split.apply()
    patch.apply()
    train_in_lockstep([split_model, patch_model], steps=2)
    # Negative control: float32 (not None) children cast their inputs to fp32, moving the
    # activation boundary: the next bf16 layer then rejects the fp32 activations.
    wrong = compile_param_dtype_maps(
        wrong_model, PrecisionRules(rules=rules), net_units(wrong_model), layout="separate_units"
    )
    fp32_children = MixedPrecisionPolicy(param_dtype=fp32, reduce_dtype=fp32)
    wrong = replace(
        wrong,
        units=tuple(
            replace(u, policy=fp32_children) if u.separate_unit else u for u in wrong.units
        ),
    )
    wrong.apply()
    with pytest.raises(RuntimeError, match="must have the same dtype, but got Float and BFloat16"):
        train_in_lockstep([patch_model, wrong_model], steps=1)


class CastingRouter(nn.Linear):
    """Casts its input to its own (gathered) weight's dtype, and the result back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype)).to(x.dtype)


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16)])  # so that net_units() applies
        self.router = CastingRouter(16, 4, bias=False)
        self.head = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](x)
        return self.head(h) * self.router(h).softmax(-1).mean(-1, keepdim=True)


def _bf16_net_with_fp32_gates() -> nn.Module:
    model = Net().to(bf16)
    for block in model.blocks:
        block.gate.float()
    return model


SEPARATE_PARITY = [
    # (model, rules, kept units and their param_dtype, input dtype)
    (Net, dict(rules=(ModuleClass(nn.LayerNorm), Glob("*gate.weight"))), [None] * 5, fp32),
    (Routed, dict(rules=(Glob("router.weight", fp16),)), [fp16], fp32),  # a third dtype
    (  # stored in bf16 with fp32 gates (what from_pretrained gives), storage dtypes kept
        _bf16_net_with_fp32_gates,
        dict(param_dtype=None, rules=(Glob("*gate.weight"),)),
        [None] * 2,
        bf16,
    ),
]


def with_boundary(rules: dict, boundary: str) -> dict:
    return {**rules, "rules": tuple(replace(r, boundary=boundary) for r in rules["rules"])}


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("boundary", ["none", "auto"])
@pytest.mark.parametrize(("make", "rules", "kept", "dtype"), SEPARATE_PARITY)
def test_wrap_separate_units_trains_like_the_mapped_plan(
    make, rules, kept, dtype, boundary
) -> None:
    from fsdp_precision import testing
    from fsdp_precision._plan.separate import separate_layout

    torch.manual_seed(0)
    ours = make()
    rules = with_boundary(rules, boundary)
    plan = compile_param_dtype_maps(ours, PrecisionRules(**rules), net_units(ours))
    layout = separate_layout(plan)
    if boundary == "none":  # no cast: the kept units leave the activations alone
        assert [u.policy.param_dtype for u in layout if u.kept] == kept
        # param_dtype=None casts nothing whatever cast_forward_inputs says (the caller's, kept);
        # a kept unit with a param_dtype of its own casts no input
        assert all(
            u.policy.cast_forward_inputs is (u.policy.param_dtype is None) for u in layout if u.kept
        )
    else:  # the boundary casts are the kept units' own input (and output) casts
        assert plan.module_casts and all(u.policy.cast_forward_inputs for u in layout if u.kept)
        assert [u.policy.param_dtype for u in layout if u.kept] == [
            c.inputs for c in plan.module_casts.values()
        ]
    reference = testing.wrap_separate_units(copy.deepcopy(ours), plan)
    plan.apply()
    train_in_lockstep([ours, reference], steps=2, make_input=lambda step: inputs(step).to(dtype))


def test_wrap_separate_units_needs_the_planned_structure() -> None:
    model = Net()
    plan = plan_of(model, Glob("*gate.weight"))
    from fsdp_precision.testing import wrap_separate_units

    with pytest.raises(ValueError, match=r"model does not have the planned model's parameters"):
        wrap_separate_units(Net(depth=3), plan)
