"""0-dim parameters a plan replicates (CLIP's ``logit_scale``, SigLIP's ``logit_bias``), on 2 gloo
ranks: they live on the mesh's device (FSDP never moves the parameters it ignores, so a model
built on the CPU and sharded onto GPUs all-reduced CPU tensors on an NCCL group), and their
gradients are averaged over the ranks in one flat all-reduce at the end of each backward, not one
synchronous all-reduce per scalar inside it (issue 53)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_precision as fp
from fsdp_precision._plan.replicated import average_gradients
from fsdp_precision.testing import CollectiveRecorder

from tests.support.harness import collect_cases, distributed_suite


class TwoScalars(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.logit_scale = nn.Parameter(torch.tensor(2.6592))
        self.logit_bias = nn.Parameter(torch.tensor(-10.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.logit_scale.exp() + self.logit_bias


def batch(micro: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10 * micro + dist.get_rank())
    return torch.randn(4, 8, generator=generator)


def case_one_all_reduce_per_backward_averages_every_scalar() -> None:
    torch.manual_seed(0)
    model, reference = TwoScalars(), TwoScalars()
    reference.load_state_dict(model.state_dict())
    rules = fp.PrecisionRules(param_dtype=torch.float32, reduce_dtype=torch.float32, advice="off")
    plan = fp.compile_param_dtype_maps(model, rules, [model.proj, model])
    assert [p.fqn for p in plan.replicated] == ["logit_scale", "logit_bias"]
    assert plan.totals()["all_reduces_per_step"] == 1  # one dtype: one flat all-reduce
    plan.apply()
    expected = {"logit_scale": torch.zeros(()), "logit_bias": torch.zeros(())}
    for micro in range(2):
        with CollectiveRecorder() as recorder:
            model(batch(micro)).sum().backward()
        reduces = recorder.of("all_reduce")
        assert [(r.dtype, r.input_bytes) for r in reduces] == [(torch.float32, 8)], reduces
        reference(batch(micro)).sum().backward()
        for name in expected:
            grad = reference.get_parameter(name).grad
            assert grad is not None
            local = grad.clone()
            dist.all_reduce(local)
            expected[name] += local / 2
            reference.get_parameter(name).grad = None
        for name, value in expected.items():
            got = model.get_parameter(name).grad
            assert got is not None and got.device == torch.device("cpu")
            torch.testing.assert_close(got, value, rtol=0, atol=1e-6)


def case_frozen_scalars_are_placed_and_not_averaged() -> None:
    """Which device a CUDA mesh gives is ``mesh_device``'s (tests/base/test_devices.py); moving
    a CPU parameter onto it is ``param.data = param.data.to(device)``, which keeps the object
    FSDP holds in ``ignored_params`` (a GPU run confirms the move itself)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    trained = nn.Parameter(torch.tensor(1.0))
    frozen = nn.Parameter(torch.tensor(1.0), requires_grad=False)
    assert average_gradients([trained, frozen], mesh) == 1
    assert trained.device == frozen.device == torch.device("cpu")


CASES = collect_cases(globals())
results, test_replicated = distributed_suite(2, __name__, CASES)
