"""Ranks agree on every ``fully_shard`` call (2 CPU ranks, gloo): a map that differs on one rank
is the same ``RankMismatchError`` on every rank, within seconds, before anything is sharded, not
a gloo abort ("Received data size doesn't match expected size") or an NCCL hang. Through the
per-call policy, ``model_policy`` and a plan; one 16-byte all-gather per call when they agree;
off with ``apply_param_dtype_map_patch(check_ranks=False)`` (the negative control).

The same cases run with the ranks as threads of one process (torch's threaded process group, as
PyTorch's own ``FSDPTestMultiThread`` tests run): calls are told apart per process group, not
numbered per process, so ranks sharing a process agree, and ranks that made different numbers of
calls on other groups (a sub-mesh only some ranks hold) agree too."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import fsdp_precision as fp
from fsdp_precision import ParamDtypeMixedPrecisionPolicy, RankMismatchError
from fsdp_precision.testing import CollectiveRecorder

from tests.support.harness import collect_cases, distributed_suite
from tests.support.models import bf16, fp32

SECONDS = 10  # a rank that waited for the other would take the group's 60 s timeout


def seq() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))


@contextmanager
def every_rank_raises(
    match: str, error: type[Exception] = RankMismatchError, same: bool = True
) -> Iterator[list[str]]:
    """The block raises ``error`` on this rank within seconds, and (``same``) every rank got
    the same message; the message is appended to the list the block receives."""
    start = time.monotonic()
    seen: list[str] = []
    with pytest.raises(error, match=match) as caught:
        yield seen
    assert time.monotonic() - start < SECONDS
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, str(caught.value))
    if same:
        assert len(set(messages)) == 1, messages
    seen.append(str(caught.value))


def unsharded(model: nn.Module) -> bool:
    return not any(isinstance(p, DTensor) for p in model.parameters())


def case_one_rank_maps_one_more_parameter() -> None:
    model = seq()
    extra = {"1.bias": fp32} if dist.get_rank() == 1 else {}
    policy = ParamDtypeMixedPrecisionPolicy(
        param_dtype=bf16, reduce_dtype=fp32, param_dtype_map={"1.weight": fp32, **extra}
    )
    with every_rank_raises(
        r"fully_shard call #\d+ over ranks \[0, 1\] differs across ranks: rank 1 resolved something other than "
        r"rank 0: parameter #3: '1.bias' \[8\] float32 -> float32 \(mapped\) where the other has "
        r"'1.bias' \[8\] float32 -> bfloat16\. A map must be the same on every rank"
    ):
        fully_shard(model, mp_policy=policy)
    assert unsharded(model)
    fully_shard(model, mp_policy=MixedPrecisionPolicy(bf16, fp32))  # the call can be retried
    assert not unsharded(model)


def case_one_rank_refuses_the_call() -> None:
    model = seq()
    key = "1.wieght" if dist.get_rank() == 1 else "1.weight"
    policy = ParamDtypeMixedPrecisionPolicy(
        param_dtype=bf16, reduce_dtype=fp32, param_dtype_map={key: fp32}
    )
    if dist.get_rank() == 1:  # its own error, with the did-you-mean
        with every_rank_raises(r"did you mean '1.weight'", fp.ParamDtypeMapError, same=False):
            fully_shard(model, mp_policy=policy)
    else:
        with every_rank_raises(
            r"rank 1 refused it \(param_dtype_map key '1.wieght' matches no parameter.*\); "
            r"ranks \[0\] did not",
            same=False,
        ):
            fully_shard(model, mp_policy=policy)
    assert unsharded(model)


def case_one_rank_passes_a_plain_policy() -> None:
    model = seq()
    policy: MixedPrecisionPolicy = (
        MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
        if dist.get_rank() == 1
        else ParamDtypeMixedPrecisionPolicy(bf16, fp32, param_dtype_map={"0.weight": fp32})
    )
    with every_rank_raises(r"parameter #0: '0.weight' \[8, 8\] float32 -> bfloat16 where"):
        fully_shard(model, mp_policy=policy)
    assert unsharded(model)


def _rules() -> fp.PrecisionRules:
    extra = (fp.Glob("1.bias"),) if dist.get_rank() == 1 else ()
    return fp.PrecisionRules(rules=(fp.Glob("1.weight"), *extra), advice="off")


def case_model_policy_and_plans_differ_on_one_rank() -> None:
    ways: list[Callable[[nn.Sequential], None]] = [
        lambda m: fully_shard(m, mp_policy=fp.model_policy(m, _rules())),
        lambda m: fp.compile_param_dtype_maps(m, _rules(), [m]).apply(),
    ]
    for way in ways:
        model = seq()
        with every_rank_raises(r"differs across ranks: rank 1 resolved .* '1.bias'"):
            way(model)
        assert unsharded(model)


def case_agreeing_ranks_pay_one_small_all_gather_per_call() -> None:
    model = seq()
    policy = ParamDtypeMixedPrecisionPolicy(bf16, fp32, param_dtype_map={"1.weight": fp32})
    with CollectiveRecorder() as recorder:
        fully_shard(model[0], mp_policy=policy.__class__(bf16, fp32))
        fully_shard(model, mp_policy=policy)
    gathers = recorder.of("all_gather")
    assert [(g.input_bytes, g.group_size) for g in gathers] == [(16, 2), (16, 2)]
    assert not unsharded(model)


def case_negative_control_without_the_check_construction_succeeds() -> None:
    # The divergence is not seen at construction: it would surface at the first all-gather
    # (a gloo abort), which this case does not run.
    fp.apply_param_dtype_map_patch(check_ranks=False)
    try:
        model = seq()
        extra = {"1.bias": fp32} if dist.get_rank() == 1 else {}
        policy = ParamDtypeMixedPrecisionPolicy(
            bf16, fp32, param_dtype_map={"1.weight": fp32, **extra}
        )
        with CollectiveRecorder() as recorder:
            fully_shard(model, mp_policy=policy)
        assert not unsharded(model) and not recorder.calls
    finally:
        fp.apply_param_dtype_map_patch(check_ranks=True)


def case_calls_on_a_group_only_one_rank_holds_do_not_shift_the_others() -> None:
    # Rank 0 first wraps a model of its own over a one-rank group; then both ranks wrap the
    # same model over the world: they agree. (Numbered per process, rank 0's world call was its
    # second and rank 1's its first: a false RankMismatchError.)
    own = dist.new_group([0])  # every rank creates every group; only rank 0 belongs to it
    if dist.get_rank() == 0:
        mesh = DeviceMesh.from_group(own, "cpu")
        policy = ParamDtypeMixedPrecisionPolicy(bf16, fp32, param_dtype_map={"weight": fp32})
        fully_shard(nn.Linear(8, 8), mesh=mesh, mp_policy=policy)
    model = seq()
    fully_shard(
        model,
        mp_policy=ParamDtypeMixedPrecisionPolicy(bf16, fp32, param_dtype_map={"1.weight": fp32}),
    )
    assert not unsharded(model)


def case_a_call_is_named_by_its_number_on_its_group() -> None:
    # A differing call, an agreeing one, and the differing one again: numbered two apart, the
    # same number on every rank (every_rank_raises checks the messages are equal).
    map_ = {"1.bias": fp32} if dist.get_rank() == 1 else {}
    numbers = []
    for agreeing in (False, True, False):
        if agreeing:
            fully_shard(seq(), mp_policy=MixedPrecisionPolicy(bf16, fp32))
            continue
        with every_rank_raises(r"^fully_shard call #\d+ over ranks \[0, 1\] differs") as seen:
            fully_shard(
                seq(), mp_policy=ParamDtypeMixedPrecisionPolicy(bf16, fp32, param_dtype_map=map_)
            )
        numbers.append(int(seen[0].split("#")[1].split()[0]))
    assert numbers[1] == numbers[0] + 2, numbers


CASES = collect_cases(globals())
# Flipping the process-wide check mid-case cannot be done by one thread for itself.
THREAD_CASES = [
    c for c in CASES if c != "case_negative_control_without_the_check_construction_succeeds"
]

results, test_agree = distributed_suite(2, __name__, CASES)
results_threads, test_agree_threads = distributed_suite(2, __name__, THREAD_CASES, threads=True)


def test_check_ranks_takes_only_a_bool() -> None:
    with pytest.raises(ValueError, match=r"check_ranks must be True, False or None, got 'no'"):
        fp.apply_param_dtype_map_patch(check_ranks="no")  # type: ignore[arg-type]
