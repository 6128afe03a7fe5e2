"""Ranks agree under HSDP (4 CPU ranks, gloo, a 2x2 mesh): a call that differs inside one shard
group raises ``RankMismatchError`` on all four ranks within seconds. The agreement compares the
shard group, then the replicate group, and raises only after both: when a shard group raised as
soon as it saw its own difference, the other shard group waited on the replicate group's
all-gather until the group's timeout (an NCCL hang on GPUs; issue 53)."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdp_precision import ParamDtypeMapError, ParamDtypeMixedPrecisionPolicy, RankMismatchError

from tests.policy.test_agree import every_rank_raises, seq, unsharded
from tests.support.harness import collect_cases, distributed_suite
from tests.support.models import bf16, fp32


def case_a_difference_in_one_shard_group_stops_every_rank() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = seq()
    extra = {"1.bias": fp32} if dist.get_rank() == 1 else {}  # shard group [0, 1] differs
    policy = ParamDtypeMixedPrecisionPolicy(
        param_dtype=bf16, reduce_dtype=fp32, param_dtype_map={"1.weight": fp32, **extra}
    )
    match = {  # rank 3 sees rank 1 differ in its replicate group; rank 2 sees nothing itself
        0: r"over ranks \[0, 1\] differs across ranks: rank 1 resolved something other",
        1: r"over ranks \[0, 1\] differs across ranks: rank 1 resolved something other",
        2: r"over ranks \[0, 2\]: ranks of another group of the mesh resolved it differently",
        3: r"over ranks \[1, 3\] differs across ranks: rank 3 resolved something other",
    }[dist.get_rank()]
    with every_rank_raises(match, same=False):
        fully_shard(model, mesh=mesh, mp_policy=policy)
    assert unsharded(model)
    fully_shard(model, mesh=mesh, mp_policy=ParamDtypeMixedPrecisionPolicy(bf16, fp32))
    assert not unsharded(model)  # every rank can retry


def case_a_refusal_in_one_shard_group_stops_every_rank() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = seq()
    key = "1.wieght" if dist.get_rank() == 3 else "1.weight"
    policy = ParamDtypeMixedPrecisionPolicy(
        param_dtype=bf16, reduce_dtype=fp32, param_dtype_map={key: fp32}
    )
    match = {
        0: r"over ranks \[0, 2\]: ranks of another group of the mesh",
        1: r"over ranks \[1, 3\] differs across ranks: rank 3 refused it",
        2: r"over ranks \[2, 3\] differs across ranks: rank 3 refused it",
        3: r"did you mean '1.weight'",  # its own error
    }[dist.get_rank()]
    error = ParamDtypeMapError if dist.get_rank() == 3 else RankMismatchError
    with every_rank_raises(match, error, same=False):
        fully_shard(model, mesh=mesh, mp_policy=policy)
    assert unsharded(model)


CASES = collect_cases(globals())
results, test_agree_hsdp = distributed_suite(4, __name__, CASES)
