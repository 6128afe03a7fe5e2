"""bf16 checkpoints: a user rule that keeps a parameter stored narrower upcasts its storage
exactly (fp32 master weights) when the plan is applied, and says so; a model's own declaration
stored narrower is refused ("precision was lost"), with fixes that work."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import fsdp_precision as fp
from fsdp_precision import ParamDtypeMapError, hf
from fsdp_precision._base.dtypes import exact_upcast

from tests.policy.test_casts import model, rules, run, wrap
from tests.support.models import bf16, fp16, fp32

KEPT = ("*router.weight", "*norm.weight")


def test_a_user_rule_plans_the_upcast_and_says_so() -> None:
    m = model().to(bf16)
    plan = fp.compile_param_dtype_maps(m, rules(*KEPT), [*m.layers, m])
    assert all(p.dtype == bf16 for p in m.parameters())  # planning touches nothing
    upcast = {p.fqn: (p.upcast_from, p.storage, p.compute) for p in plan.upcasts}
    assert upcast == {
        f"layers.{i}.{k}.weight": (bf16, fp32, fp32) for i in (0, 1) for k in ("norm", "router")
    }
    assert "(stored in bfloat16: upcast exactly when applied)" in plan.explain()
    params = {p["fqn"]: p for u in plan.to_dict()["units"] for p in u["params"]}
    assert params["layers.0.router.weight"]["upcast_from"] == "bfloat16"
    assert params["layers.0.up.weight"]["upcast_from"] is None


@pytest.mark.usefixtures("world1")
def test_apply_upcasts_exactly_and_keeps_the_parameters() -> None:
    m = model().to(bf16)
    router = m.layers[0].router.weight
    before = router.detach().clone()
    plan = fp.compile_param_dtype_maps(m, rules(*KEPT), [*m.layers, m])
    plan.apply()
    run(m)
    assert m.layers[0].router.weight.dtype == fp32
    assert torch.equal(m.layers[0].router.weight.full_tensor().to(bf16), before)
    assert m.layers[0].up.weight.dtype == bf16


@pytest.mark.usefixtures("world1")
def test_a_refused_plan_leaves_the_storage_as_it_was() -> None:
    m = model().to(bf16)
    plan = fp.compile_param_dtype_maps(m, rules(*KEPT), [*m.layers, m])
    fully_shard(m.layers[0])  # wrapped before: the plan's check refuses
    with pytest.raises(ValueError, match="already sharded"):
        plan.apply()
    plain = [p for n, p in m.named_parameters() if not n.startswith("layers.0.")]
    assert all(p.dtype == bf16 and not isinstance(p, DTensor) for p in plain)


@pytest.mark.usefixtures("world1")
def test_model_policy_upcasts_once_every_check_passed() -> None:
    m = model().to(bf16)
    with pytest.raises(ParamDtypeMapError, match="matches no parameter"):
        fp.model_policy(m, rules(*KEPT, "*nothing*"))
    assert all(p.dtype == bf16 for p in m.parameters())  # refused: untouched
    wrap(m, fp.model_policy(m, rules(*KEPT)))
    assert m.layers[1].norm.weight.dtype == fp32


def test_a_declaration_stored_narrower_is_refused_with_fixes_that_work() -> None:
    pytest.importorskip("transformers", reason="needs the hf extra (transformers)")
    from tests.support.hf_models import t5

    lost = t5().to(fp16)  # .to() undoes the declaration: wo is fp16 already
    with pytest.raises(ParamDtypeMapError) as caught:
        fp.compile_param_dtype_maps(lost, fp.PrecisionRules(param_dtype=fp16))
    message = str(caught.value)
    fqn = "encoder.block.0.layer.1.DenseReluDense.wo.weight"
    assert f"parameter {fqn!r} is kept in float32 by transformers _keep_in_fp32_modules" in message
    assert "precision was lost" in message and "a correct load keeps it" in message
    # Fix 1: the keep-aware cast of an fp32 model, with the rules.
    rules_ = fp.PrecisionRules(param_dtype=fp16, rules=(fp.Glob("*.SelfAttention.o.weight"),))
    fixed = hf.cast_keeping_fp32(t5(), fp16, rules=rules_)
    assert fixed.get_parameter(fqn).dtype == fp32
    assert fixed.get_parameter("encoder.block.0.layer.0.SelfAttention.o.weight").dtype == fp32
    assert fixed.get_parameter("encoder.block.0.layer.0.SelfAttention.q.weight").dtype == fp16
    assert not fp.compile_param_dtype_maps(fixed, rules_).upcasts
    # Fix 2: the checkpoint itself is fp16: a user rule upcasts it exactly.
    plan = fp.compile_param_dtype_maps(
        lost, fp.PrecisionRules(param_dtype=fp16, rules=(fp.Glob("*.wo.weight"),))
    )
    assert fqn in {p.fqn for p in plan.upcasts}


def test_cast_keeping_fp32_checks_its_rules() -> None:
    pytest.importorskip("transformers", reason="needs the hf extra (transformers)")
    from tests.support.hf_models import t5

    with pytest.raises(TypeError, match="rules must be a PrecisionRules"):
        hf.cast_keeping_fp32(t5(), fp16, rules=[fp.Glob("*")])  # type: ignore[arg-type]
    with pytest.raises(ParamDtypeMapError, match="matches no parameter"):
        hf.cast_keeping_fp32(t5(), fp16, rules=fp.PrecisionRules(rules=(fp.Glob("*gate*"),)))


EXACT = [
    (bf16, fp32, True),
    (fp16, fp32, True),
    (fp16, bf16, False),  # same size, and bf16 has fewer mantissa bits
    (fp32, bf16, False),
    (torch.float8_e4m3fn, fp16, True),
    (torch.float8_e5m2, bf16, True),
    (torch.int8, fp32, False),
]


@pytest.mark.parametrize(("storage", "kept", "exact"), EXACT)
def test_exact_upcasts(storage: torch.dtype, kept: torch.dtype, exact: bool) -> None:
    assert exact_upcast(storage, kept) is exact
