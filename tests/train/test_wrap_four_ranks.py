"""wrap_model_for_training on 4 ranks: FSDP 1x4 and HSDP 2x2 (replicate x shard)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp_precision import (
    DistributedConfig,
    Glob,
    PrecisionRules,
    plan_model_for_training,
    wrap_model_for_training,
)

from tests.support.harness import collect_cases, distributed_suite
from tests.support.models import clones, inputs, local, loss_of, net, train_in_lockstep

# No boundary casts: the comparison is the hand-written mapped wrap of tests/patch/test_parity,
# whose per-call maps cast no activations (boundary casts: tests/policy/test_casts.py).
KEEP = (
    Glob("*norm.weight", boundary="none"),
    Glob("*norm.bias", boundary="none"),
    Glob("*gate.weight", boundary="none"),
)
HSDP_2X2 = DistributedConfig(
    parallel_strategy="hsdp",
    hsdp_replicate_size=2,
    fsdp_auto_wrap_min_params=900,
    fsdp_mixed_precision=PrecisionRules(rules=KEEP),
)


def case_fsdp_1x4() -> None:
    from tests.patch.test_parity import wrap_mapped

    ours, manual = clones(net(), 2)
    wrap_model_for_training(
        ours,
        DistributedConfig(
            fsdp_auto_wrap_min_params=900, fsdp_mixed_precision=PrecisionRules(rules=KEEP)
        ),
    )
    wrap_mapped(manual)
    train_in_lockstep([ours, manual], steps=2)
    assert ours.head.weight.device_mesh.shape == (4,)


def case_hsdp_2x2() -> None:
    config = HSDP_2X2
    model = wrap_model_for_training(net(), config)
    weight = model.blocks[0].up.weight
    assert isinstance(weight, DTensor) and weight.device_mesh.shape == (2, 2)
    assert weight.device_mesh.mesh_dim_names == ("replicate", "shard")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        loss_of(model(inputs(step))).backward()
        optim.step()
        optim.zero_grad()
    # Replicas hold identical shards after training.
    replicate = weight.device_mesh.get_group("replicate")
    shard = local(model.blocks[0].up.weight).contiguous()
    peers = [torch.empty_like(shard) for _ in range(2)]
    dist.all_gather(peers, shard, group=replicate)
    assert torch.equal(peers[0], peers[1])
    assert model.blocks[0].gate.weight.dtype == torch.float32


def case_hsdp_counts_the_all_reduce_across_replicas() -> None:
    from tests.train.test_wrap import planned_step, recorded_step

    config = HSDP_2X2
    model = net()
    plan = plan_model_for_training(model, config)
    assert plan.hsdp and plan.world_size == 2
    wrap_model_for_training(model, config)
    recorded = recorded_step(model)
    assert recorded == planned_step(plan.totals()), recorded
    assert recorded[2] == len(plan.units)  # one all-reduce per trainable unit


def case_hsdp_replicas_must_divide_world() -> None:
    config = DistributedConfig(parallel_strategy="hsdp", hsdp_replicate_size=3)
    with pytest.raises(ValueError, match=r"hsdp_replicate_size=3 does not divide the world size 4"):
        wrap_model_for_training(net(), config)


CASES = collect_cases(globals())

results, test_four_ranks = distributed_suite(4, __name__, CASES)
