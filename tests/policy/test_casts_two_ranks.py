"""Boundary casts on two ranks: the collectives stay the uniform policy's, and training is
bitwise the nested-unit layout's with the same casts (which pays more collectives)."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import fsdp_precision as fp

from tests.policy.test_casts import model, rules, run, wrap
from tests.support.harness import collect_cases, distributed_suite
from tests.support.models import bf16, fp32

KEPT = ("*router.weight", "*norm.weight")


def counted(
    m: torch.nn.Module,
) -> tuple[tuple[torch.Tensor, dict[str, torch.Tensor]], tuple[int, int]]:
    from fsdp_precision._observe.collectives import CollectiveRecorder

    with CollectiveRecorder() as recorder:
        result = run(m)
    return result, (recorder.count("all_gather"), recorder.count("reduce_scatter"))


def case_the_casts_add_no_collective_and_match_nested_units() -> None:
    ours, uniform, nested = model(), model(), model()
    wrap(ours, fp.model_policy(ours, rules(*KEPT)))
    wrap(uniform, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))
    plan = fp.compile_param_dtype_maps(
        nested, rules(*KEPT), [*nested.layers, nested], layout="separate_units"
    )
    plan.apply()
    (loss, grads), ours_counts = counted(ours)
    _, uniform_counts = counted(uniform)
    (nested_loss, nested_grads), nested_counts = counted(nested)
    assert ours_counts == uniform_counts and ours_counts[0] > 0, (ours_counts, uniform_counts)
    assert nested_counts[0] > ours_counts[0]  # the counter sees units: the control
    assert torch.equal(loss, nested_loss)
    assert all(torch.equal(grads[n], nested_grads[n]) for n in grads)


CASES = collect_cases(globals())
results, test_two_ranks = distributed_suite(2, __name__, CASES)
