"""Every field of the caller's rules reaches every ``fully_shard`` call, through every path
(verl's seed contract: the policy "preserves all other fields from the caller's mixed-precision
policy"), read back from what torch's FSDP state holds after wrapping, on one gloo rank.

Paths: ``model_policy`` (one object for the calls a framework makes), a plan in each layout,
``wrap_model_for_training``; on torch 2.15 the mapped calls go through the native override,
which this reads too. Fields: ``param_dtype``, ``reduce_dtype``, ``output_dtype``,
``cast_forward_inputs``. The kept child units of the separate-units layout keep every field but
``param_dtype`` (``None``: they compute in their storage dtype), as verl builds them with
``replace(mp_policy, param_dtype=None)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard

import fsdp_precision as fp
from fsdp_precision.testing import GatherProbe

from tests.support.models import net

pytestmark = pytest.mark.usefixtures("world1")
bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
# The routers, which cast for themselves (``boundary="none"``), inside the blocks: no unit is
# kept whole. (A kept module with a boundary cast made its own unit takes the boundary's
# fields: FSDP's own input and output casts, tests/plan/test_units.py.)
KEEP = (fp.Glob("blocks.*.gate.weight", boundary="none"),)

CALLERS = {
    "no_input_cast": fp.PrecisionRules(
        param_dtype=bf16, reduce_dtype=fp32, cast_forward_inputs=False, rules=KEEP
    ),
    "fp32_outputs": fp.PrecisionRules(
        param_dtype=bf16, reduce_dtype=fp32, output_dtype=fp32, rules=KEEP
    ),
    "fp16_bf16_outputs_no_cast": fp.PrecisionRules(
        param_dtype=fp16,
        reduce_dtype=fp32,
        output_dtype=bf16,
        cast_forward_inputs=False,
        rules=KEEP,
    ),
}


def by_policy(model: nn.Module, rules: fp.PrecisionRules) -> None:
    policy = fp.model_policy(model, rules)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def by_plan(layout: str) -> Callable[[nn.Module, fp.PrecisionRules], None]:
    def wrap(model: nn.Module, rules: fp.PrecisionRules) -> None:
        units = [*model.blocks, model]
        fp.compile_param_dtype_maps(model, rules, units, layout=layout).apply()

    return wrap


def by_wrap(model: nn.Module, rules: fp.PrecisionRules) -> None:
    config = fp.DistributedConfig(
        fsdp_mixed_precision=rules,
        fsdp_auto_wrap_policy="transformer_block",
        fsdp_transformer_block_classes=("Block",),
    )
    fp.wrap_model_for_training(model, config)


PATHS: dict[str, Callable[[nn.Module, fp.PrecisionRules], None]] = {
    "model_policy": by_policy,
    "plan_in_unit": by_plan("in_unit"),
    "plan_separate_units": by_plan("separate_units"),
    "wrap_model_for_training": by_wrap,
}


def received(model: nn.Module) -> dict[str, Any]:
    """The policy torch's FSDP state holds for each unit, by the unit's module name."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()  # type: ignore[attr-defined]
            (group,) = state._fsdp_param_groups
            found[name] = group.mp_policy
    return found


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("caller", CALLERS)
def test_every_field_reaches_every_call(caller: str, path: str) -> None:
    rules = CALLERS[caller]
    model = net()
    PATHS[path](model, rules)
    units = received(model)
    kept = {n for n in units if n.endswith(".gate")}
    assert set(units) - kept == {"", "blocks.0", "blocks.1"}, sorted(units)
    assert bool(kept) == (path == "plan_separate_units"), sorted(units)
    for name, policy in units.items():
        param_dtype = None if name in kept else rules.param_dtype
        fields = (policy.param_dtype, policy.reduce_dtype, policy.output_dtype)
        assert fields == (param_dtype, rules.reduce_dtype, rules.output_dtype), (name, policy)
        assert policy.cast_forward_inputs == rules.cast_forward_inputs, (name, policy)
    if rules.output_dtype is not None:
        return  # unit outputs in another dtype meet the root's own layers: the caller's choice
    with GatherProbe(model) as probe:
        model(torch.randn(4, 16, dtype=rules.param_dtype)).float().sum().backward()
    assert probe.seen["blocks.0.gate.weight"].dtype == fp32
    assert probe.seen["blocks.0.up.weight"].dtype == rules.param_dtype
