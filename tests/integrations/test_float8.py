"""torchao float8 training with kept parameters in the same FSDP unit, on 2 CPU ranks (gloo).

``Float8Linear`` weights with ``enable_fsdp_float8_all_gather=True`` all-gather in float8 (1 byte
per element) by their own ``fsdp_pre_all_gather``, beside the routers kept in fp32 and the norms
in bf16: one all-gather per unit, FSDP packing the mixed inputs as bytes. The reference for the
numerics is the public-API layout, each router a separate fp32 unit: on gloo it runs as long as
every unit keeps a non-float8 parameter (here the block's norm), because a unit whose inputs are
all float8 all-gathers in float8, which gloo rejects ("Invalid scalar type"; NCCL takes it).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fsdp_precision as fp
from fsdp_precision.testing import CollectiveRecorder, GatherProbe

from tests.support.harness import collect_cases, distributed_suite
from tests.support.models import RoutedNet, assert_same_params, bf16, fp32, local

float8 = pytest.importorskip(
    "torchao.float8", reason="torchao is not installed (pip install '.[torchao]')"
)

RULES = fp.PrecisionRules(rules=(fp.Glob("*.gate.weight"),), advice="off")


def float8_model(biases: bool = True) -> RoutedNet:
    """RoutedNet with its block MLPs as torchao ``Float8Linear`` (float8 all-gather), the
    routers, norms and head as they were."""
    torch.manual_seed(0)
    model = RoutedNet()
    if not biases:
        for block in model.blocks:
            block.up.bias = block.down.bias = None
    config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    float8.convert_to_float8_training(
        model, config=config, module_filter_fn=lambda _, fqn: fqn.endswith(("up", "down"))
    )
    return model


def units(model: nn.Module) -> list[nn.Module]:
    return [*model.blocks, model]  # type: ignore[attr-defined]


def shard(model: RoutedNet, how: str) -> RoutedNet:
    if how == "model_policy":
        policy: Any = fp.model_policy(model, RULES)
        for unit in units(model):
            fully_shard(unit, mp_policy=policy)
    elif how == "plan":
        fp.compile_param_dtype_maps(model, RULES, units(model)).apply()
    elif how == "separate_units":
        fp.compile_param_dtype_maps(model, RULES, units(model), layout="separate_units").apply()
    else:  # the plain float8 run: one uniform policy, the routers in bf16
        policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
        for unit in units(model):
            fully_shard(unit, mp_policy=policy)
    return model


def step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> torch.Tensor:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
    loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def case_float8_weights_gather_as_one_byte_beside_kept_routers() -> None:
    for how in ("model_policy", "plan"):
        model = float8_model()
        plan = fp.compile_param_dtype_maps(model, RULES, units(model), world_size=2)
        shard(model, how)
        with CollectiveRecorder() as rec, GatherProbe(model) as probe:
            model(torch.randn(8, 16)).float().sum().backward()
        gathers = rec.of("all_gather")
        # bytes on the wire: float8 1 byte per element, the routers fp32, the rest bf16, as
        # the plan says (forward and backward gather each block; the root once)
        root, blocks = plan.units[-1], plan.units[:-1]
        planned = [sum(u.gather_bytes(2).values()) for u in (root, *blocks, *blocks[::-1])]
        assert [g.output_bytes for g in gathers] == planned, (how, gathers, planned)
        block = plan.units[0].gather_bytes(2)
        assert block == {
            "float8": 2 * 16 * 32,
            "float32": 4 * 4 * 16,
            "bfloat16": 2 * (2 * 16 + 32 + 16),
        }
        gates = {n for n in probe.seen if n.endswith("gate.weight")}
        assert len(gates) == 2 and {probe.seen[n].dtype for n in gates} == {fp32}
        # the same all-gathers per step as the plain float8 run
        plain = shard(float8_model(), "plain")
        with CollectiveRecorder() as plain_rec:
            plain(torch.randn(8, 16)).float().sum().backward()
        assert len(plain_rec.of("all_gather")) == len(gathers)
        assert len(plain_rec.of("reduce_scatter")) == len(rec.of("reduce_scatter"))


def case_training_is_bitwise_the_separate_units_layout() -> None:
    ours, reference = shard(float8_model(), "model_policy"), shard(float8_model(), "separate_units")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, reference)]
    for i in range(3):
        loss, ref_loss = step(ours, opts[0], i), step(reference, opts[1], i)
        assert torch.equal(loss, ref_loss), (i, loss, ref_loss)
    assert_same_params(ours, reference)
    up = ours.blocks[0].up.weight
    assert type(local(up)).__name__ == "WeightWithDynamicFloat8CastTensor"  # still float8


def case_a_unit_of_only_float8_weights_fails_on_gloo() -> None:
    # Why the reference keeps a norm in each block: FSDP gathers a unit whose inputs are all
    # float8 in float8, and gloo has no float8 all-gather.
    model = float8_model(biases=False)
    for block in model.blocks:
        for part in (block.norm, block.gate):
            fully_shard(part, mp_policy=MixedPrecisionPolicy(param_dtype=fp32))
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))
    fully_shard(model)
    with pytest.raises(RuntimeError, match="Invalid scalar type"):
        model(torch.randn(8, 16)).float().sum().backward()


CASES = collect_cases(globals())

results, test_float8 = distributed_suite(2, __name__, CASES)


def test_a_rule_claiming_a_float8_weight_is_refused() -> None:
    model = float8_model()
    rules = fp.PrecisionRules(rules=(fp.Glob("*.up.weight"),), advice="off")
    with pytest.raises(
        fp.ParamDtypeMapError,
        match=r"glob '\*\.up\.weight' claims a parameter it cannot keep: parameter "
        r"'blocks\.0\.up\.weight' is a WeightWithDynamicFloat8CastTensor: it all-gathers in a "
        r"format of its own .* module_filter_fn",
    ):
        fp.compile_param_dtype_maps(model, rules, units(model))
    policy = fp.ParamDtypeMixedPrecisionPolicy(param_dtype_map={"up.weight": fp32})
    from fsdp_precision._policy.resolve import resolve_param_dtype_map

    block = model.blocks[0]
    with pytest.raises(fp.ParamDtypeMapError, match=r"parameter 'up\.weight' is a Weight"):
        resolve_param_dtype_map([block], list(block.parameters()), policy)
    assert type(block.up.weight).__name__ == "WeightWithDynamicFloat8CastTensor"  # untouched
