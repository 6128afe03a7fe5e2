"""The opt-in 8-rank tier (``pytest -m slow``): pipeline x FSDP x TP together, on gloo (CPU).

A (pp 2, dp 2, tp 2) mesh: the suite's MoE-style net split in two pipeline stages
(``torch.distributed.pipelining``, GPipe, 2 microbatches), each stage tensor-parallel as
torchtitan lays out its decoders (``tests/patch/test_meshes.py``) and FSDP-sharded with its own
units. Kept norms and gates in-unit are bitwise the separate-units layout over 3 AdamW steps,
gathered in fp32; every gradient all-reduce over the TP mesh runs in fp32.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from fsdp_precision.testing import CollectiveRecorder, GatherProbe

from tests.patch.test_meshes import (
    BLOCK_PLAN,
    DIM,
    TAIL_PLAN,
    TOKENS,
    pipeline_stage,
    wrap_stage,
)
from tests.support.harness import collect_cases, distributed_suite
from tests.support.models import KEEP_IN_BLOCK, Net, assert_same_grads, bf16, clones, fp32, net

pytestmark = pytest.mark.slow


def stage_on_tp(model: Net, tp: object, last: bool) -> Net:
    for block in model.blocks:
        parallelize_module(block, tp, BLOCK_PLAN)  # type: ignore[arg-type]
    if last:
        parallelize_module(model, tp, TAIL_PLAN)  # type: ignore[arg-type]
    return model


def case_pp_x_fsdp_x_tp_kept_in_unit_bitwise_separate_units() -> None:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    pp, dp, tp = mesh["pp"], mesh["dp"], mesh["tp"]
    stage, last = pp.get_local_rank(), pp.get_local_rank() == pp.size() - 1
    base = pipeline_stage(net(dim=DIM, depth=4), stage, pp.size())
    ref, ours = (stage_on_tp(m, tp, last) for m in clones(base, 2))
    wrap_stage(ref, dp, separate=True)
    wrap_stage(ours, dp, separate=False)
    schedules = [
        ScheduleGPipe(
            PipelineStage(m, stage, pp.size(), torch.device("cpu"), group=pp.get_group()),
            n_microbatches=2,
            loss_fn=lambda y, target: y.float().pow(2).mean(),
        )
        for m in (ref, ours)
    ]
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours)]
    for step in range(3):
        g = torch.Generator().manual_seed(1000 * step + dp.get_local_rank())
        x = torch.randn(TOKENS, DIM, generator=g).chunk(tp.size())[tp.get_local_rank()]
        losses: list[list[torch.Tensor]] = [[], []]
        with GatherProbe(ours) as probe, CollectiveRecorder() as rec:
            for schedule, out in zip(schedules, losses):
                if last:
                    schedule.step(target=torch.zeros_like(x), losses=out)
                else:
                    schedule.step(x)
        for name, seen in probe.seen.items():
            kept = name.endswith(KEEP_IN_BLOCK) or name.startswith("norm.")
            assert seen.dtype == (fp32 if kept else bf16), (name, seen.dtype)
        reduces = rec.of("all_reduce", functional=True)
        assert reduces and all(c.dtype == fp32 for c in reduces), reduces
        if last:
            assert len(losses[0]) == 2
            assert all(torch.equal(a, b) for a, b in zip(*losses, strict=True)), losses
        assert_same_grads(ref, ours)
        for opt in optims:
            opt.step()
            opt.zero_grad()
    dist.barrier()


CASES = collect_cases(globals())

results, test_eight_ranks = distributed_suite(8, __name__, CASES)
