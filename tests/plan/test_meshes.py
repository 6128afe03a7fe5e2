"""The plan's mesh costs (``PrecisionPlan.mesh_totals``, ``explain(meshes=...)``, ``plan --tp
--ep --pp``): tensor, expert and pipeline parallelism beside FSDP, laid out from the model's
own declared plans. What real collectives these figures match (counts and bytes, recorded on 4
gloo ranks): ``tests/patch/test_meshes.py``."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import fsdp_precision as fp
from fsdp_precision._cli import main

from tests.support.hf_models import requires_transformers_5, tiny_qwen3_moe

bf16, fp32 = torch.bfloat16, torch.float32
pytestmark = pytest.mark.fast


def qwen3_moe_plan(world_size: int = 4, layers: int = 4) -> fp.PrecisionPlan:
    pytest.importorskip("transformers", reason="the declared plans are a transformers model's")
    with torch.device("meta"):
        model = tiny_qwen3_moe(num_hidden_layers=layers)
    rules = fp.PrecisionRules(rules=(fp.Glob("*mlp.gate.weight"),), advice="off")
    return fp.compile_param_dtype_maps(model, rules, world_size=world_size)


def stage_sum(totals: dict[str, Any], key: str) -> int:
    return sum(s[key] for s in totals["stages"])


@requires_transformers_5
def test_fsdp_alone_is_the_plans_own_cost_model() -> None:
    """Every degree 1: the plan's own totals, to the byte (a negative control for the rest)."""
    plan = qwen3_moe_plan()
    totals, own = plan.mesh_totals(fp.Meshes()), plan.totals()
    [stage] = totals["stages"]
    for key in ("units", "all_gathers_per_step", "reduce_scatters_per_step"):
        assert stage[key if key != "units" else "units"] == own[key], key
    assert stage["all_gather_bytes_per_step"] == own["all_gather_bytes_per_step"]
    assert (totals["tp_sharded"], totals["experts"], totals["tp_partial"]) == (0, 0, [])
    assert "beside FSDP" not in plan.explain(meshes=fp.Meshes())


@requires_transformers_5
def test_tp_shards_by_the_declared_plan_and_prices_the_partial_gradients() -> None:
    """Qwen3-MoE's tp_plan: q/k/v/o, the shared projections, the experts and the head are
    sharded; q_norm and k_norm (replicated_with_grad_allreduce) get a TP all-reduce each, whole
    gradient, 4 bytes per element in fp32 under the patch, 2 in bf16 by torch alone; the
    router gate and the layer norms are in no entry (whole, no TP collective)."""
    plan = qwen3_moe_plan()
    alone, tp = plan.mesh_totals(fp.Meshes()), plan.mesh_totals(fp.Meshes(tp=2))
    norms = [n for n in plan.params_by_fqn if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert tp["tp_partial"] == sorted(norms) and len(norms) == 8
    assert not any("mlp.gate." in n or "layernorm" in n for n in tp["tp_partial"])
    [stage] = tp["stages"]
    numel = sum(plan.params_by_fqn[n].shape[0] for n in norms)
    assert stage["tp_all_reduces_per_step"] == 8
    assert stage["tp_all_reduce_bytes_per_step"] == 4 * numel
    assert stage["tp_all_reduce_bytes_in_compute_dtype"] == 2 * numel
    # the same collectives, fewer bytes: the sharded weights gather half
    assert stage["all_gathers_per_step"] == alone["stages"][0]["all_gathers_per_step"]
    assert stage["all_gather_bytes_per_step"] < alone["stages"][0]["all_gather_bytes_per_step"]
    lm_head = plan.params_by_fqn["lm_head.weight"]
    assert lm_head.compute == bf16 and tp["tp_sharded"] > 20
    text = plan.explain(meshes=fp.Meshes(tp=2))
    assert "TP: 8 gradient all-reduces" in text and "pytorch #190626" in text


@requires_transformers_5
def test_ep_makes_two_groups_per_moe_block_on_efsdp() -> None:
    """EP 2 at FSDP 4: the experts (the ep_plan's grouped_gemm weights) are a second group of
    each block's unit, on efsdp = 4 * 1 / 2 = 2: one more all-gather per pass and one more
    reduce-scatter per block; each rank gathers half the experts."""
    plan = qwen3_moe_plan(layers=2)
    alone, ep = plan.mesh_totals(fp.Meshes()), plan.mesh_totals(fp.Meshes(ep=2))
    assert ep["experts"] == 4 and ep["efsdp"] == 2  # gate_up_proj, down_proj per layer
    blocks = 2
    a, e = alone["stages"][0], ep["stages"][0]
    assert e["units"] == a["units"]
    assert e["all_gathers_per_step"] == a["all_gathers_per_step"] + 2 * blocks
    assert e["reduce_scatters_per_step"] == a["reduce_scatters_per_step"] + blocks
    experts = [p for p in plan.params_by_fqn.values() if ".mlp.experts." in p.fqn]
    whole = sum(p.padded_numel(4) * p.compute.itemsize for p in experts) * 2  # AG fwd + bwd
    assert a["all_gather_bytes_per_step"] - e["all_gather_bytes_per_step"] == whole // 2
    with pytest.raises(ValueError, match=r"expert parallelism of 3 .* must divide"):
        plan.mesh_totals(fp.Meshes(ep=3))


@requires_transformers_5
def test_pp_splits_the_layers_in_order_with_the_ends_on_the_end_stages() -> None:
    """PP 2 over 4 layers: layers 0-1 and the embedding on stage 0, layers 2-3, the final norm
    and the head on stage 1; each stage makes its share of the root unit its own unit."""
    plan = qwen3_moe_plan(layers=4)
    alone, pp = plan.mesh_totals(fp.Meshes()), plan.mesh_totals(fp.Meshes(pp=2))
    first, last = pp["stages"]
    assert (first["units"], last["units"]) == (3, 3)  # 2 blocks + a share of the root each
    assert (
        stage_sum(pp, "reduce_scatters_per_step")
        == alone["stages"][0]["reduce_scatters_per_step"] + 1
    )  # the root split in two
    assert (
        stage_sum(pp, "all_gather_bytes_per_step")
        == alone["stages"][0]["all_gather_bytes_per_step"]
    )
    with pytest.raises(ValueError, match=r"pp=5 stages for 4 layers: choose pp <= 4"):
        plan.mesh_totals(fp.Meshes(pp=5))


def test_a_model_without_declared_plans_is_refused_by_name() -> None:
    from tests.support.models import net

    model = net()
    plan = fp.compile_param_dtype_maps(model, fp.PrecisionRules(advice="off"), world_size=2)
    for meshes, name in ((fp.Meshes(tp=2), "tp_plan"), (fp.Meshes(ep=2), "ep_plan"),
                         (fp.Meshes(pp=2), "pp_plan")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"Net declares no {name} .* drop --"):
            plan.mesh_totals(meshes)
    assert plan.mesh_totals(fp.Meshes())["stages"][0]["units"] == plan.totals()["units"]


@pytest.mark.parametrize("bad", [{"tp": 0}, {"ep": -1}, {"pp": True}, {"tp": 2.0}])
def test_meshes_are_validated_on_construction(bad: dict[str, Any]) -> None:
    name, value = next(iter(bad.items()))
    with pytest.raises(ValueError, match=rf"Meshes\({name}=...\) must be an int >= 1"):
        fp.Meshes(**bad)


@requires_transformers_5
def test_cli_plan_prints_and_writes_the_mesh_costs(capsys: pytest.CaptureFixture[str]) -> None:
    """``plan hf:qwen3_moe --tp 2 --ep 4 --pp 4`` at full size on meta (24 layers): a line per
    stage, 6 layers each (their q_norm and k_norm: 12 TP all-reduces); the JSON carries the
    same totals; a degree the model cannot take is one line, exit 2."""
    pytest.importorskip("transformers", reason="hf:qwen3_moe is a transformers model")
    args = ["plan", "hf:qwen3_moe", "--no-trace", "--advice", "off", "--world-size", "8"]
    assert main([*args, "--tp", "2", "--ep", "4", "--pp", "4"]) == 0
    out = capsys.readouterr().out
    assert "beside FSDP 8: TP 2 x EP 4 x PP 4 (64 ranks)" in out
    stages = [line for line in out.splitlines() if line.startswith("  stage ")]
    assert len(stages) == 4 and all("TP: 12 gradient all-reduces" in s for s in stages), stages
    assert main([*args, "--tp", "2", "--ep", "4", "--pp", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["meshes"]["efsdp"] == 4 and len(data["meshes"]["stages"]) == 4
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["meshes"] is None
    assert main([*args, "--ep", "3"]) == 2
    assert "expert parallelism of 3" in capsys.readouterr().err
    assert main([*args, "--tp", "0"]) == 2
    assert "--tp must be >= 1, got 0" in capsys.readouterr().err
