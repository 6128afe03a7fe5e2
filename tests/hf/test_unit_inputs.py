"""Wan's timestep projection and rotary tables reach every block unit in fp32 (issue 30): a tiny
``WanTransformer3DModel`` with its declared keeps (``rope``, ``time_embedder``,
``scale_shift_table``, the norms), its timestep projection kept in fp32 by a rule, and
``uncast_inputs=("temb", "rotary_emb")``, on 2 gloo ranks, bitwise against the
unsharded reference that keeps those inputs as the model made them; without the names the
blocks receive them rounded to bf16 and the outputs differ. The plan's trace names the rounded
inputs and suggests exactly these two."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_precision as fp
from fsdp_precision._verify.trace import trace_compute_dtypes
from fsdp_precision.testing import verify_parity

from tests.support.harness import collect_cases, distributed_suite
from tests.support.hf_models import wan, wan_model_inputs

pytest.importorskip("diffusers", reason="diffusers is not installed (pip install '.[hf]')")
bf16, fp32 = torch.bfloat16, torch.float32


def planned(uncast: tuple[str, ...]) -> tuple[nn.Module, fp.PrecisionPlan]:
    torch.manual_seed(0)
    model = wan()
    rules = fp.PrecisionRules(  # the timestep projection kept too: temb leaves it in fp32
        param_dtype=bf16,
        reduce_dtype=fp32,
        uncast_inputs=uncast,
        rules=(fp.Glob("condition_embedder.time_proj.*"),),
    )
    units = [*model.blocks, model]  # type: ignore[attr-defined]
    return model, fp.compile_param_dtype_maps(model, rules, units)


def inputs() -> dict[str, Any]:
    batch = wan_model_inputs(torch.Generator().manual_seed(0))
    batch["timestep"] = torch.tensor([998])  # rounds to 1000 in bf16
    return batch


def rotary_dtypes(model: nn.Module) -> list[torch.dtype]:
    """What each block's self-attention receives as its rotary table."""
    seen: list[torch.dtype] = []
    for block in model.blocks:  # type: ignore[attr-defined]
        block.attn1.register_forward_pre_hook(
            lambda m, a, k: seen.append(a[3][0].dtype),
            with_kwargs=True,  # positional
        )
    return seen


def case_temb_and_rotary_tables_stay_fp32_and_match_the_reference() -> None:
    outputs = {}
    for uncast in (("temb", "rotary_emb"), ()):
        model, plan = planned(uncast)
        seen = rotary_dtypes(model)
        report = verify_parity(plan, inputs(), loss_fn=lambda out: out[0].float().pow(2).mean())
        assert report.ok, report.explain()
        assert seen and set(seen) == {fp32 if uncast else bf16}, (uncast, seen)
        with torch.no_grad():
            outputs[uncast] = model(**inputs())[0].detach()
    assert not torch.equal(outputs[("temb", "rotary_emb")], outputs[()])
    assert dist.get_world_size() == 2


def test_the_trace_suggests_temb_and_the_rotary_tables() -> None:
    _, plan = planned(())
    trace = trace_compute_dtypes(plan, inputs())
    assert trace.ok, trace.error
    # (an integer timestep here: the root unit's cast leaves it alone)
    assert set(trace.suggested_uncast()) == {"temb", "rotary_emb"}, trace.rounded_inputs
    temb = next(r for r in trace.rounded_inputs if r.argument == "temb")
    assert temb.producer.startswith("condition_embedder") and temb.dtype == "float32"
    _, kept = planned(("temb", "rotary_emb"))
    assert trace_compute_dtypes(kept, inputs()).suggested_uncast() == ()


CASES = collect_cases(globals())
results, test_two_ranks = distributed_suite(2, __name__, CASES)
