"""PyTorch's own FSDP2 initialization tests, ported to CPU, under the patch and on torch alone.

Written after ``test/distributed/_composable/fsdp/test_fully_shard_init.py`` (torch 2.13):
``TestFullyShardLazyInit``, ``TestFullyShardShardedParameterTensor``,
``TestFullyShardShardPlacementFn``, ``TestFullyShardOldImport`` and
``TestFullyShardMetaDeviceInit``. Upstream runs them as ``FSDPTestMultiThread`` (the ranks are
threads of one process over torch's threaded process group) and skips most on a machine without a
GPU; here every case runs on CPU in both process-group kinds, spawned gloo ranks and threads, with
the patch applied and on torch alone (``conformance_suites``). Under the patch each case builds its
units every way of ``tests.conformance.kinds`` (torch's policy, the library's with an empty, a
one-entry and a full map, ``model_policy``), all meaning torch's semantics: the errors are torch's
own, and what a case returns (sharded values, losses, gradients, collectives) is bitwise what torch
alone computes.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard

from fsdp_precision.testing import CollectiveRecorder

from tests.conformance.kinds import digest, kinds, policy, state_digest
from tests.conformance.test_upstream_ported import MLP
from tests.support.harness import collect_cases, conformance_suites, seeded
from tests.support.models import bf16, fp32


def two_mlps(dim: int = 8, **kw: int) -> nn.Sequential:
    with seeded(0):
        return nn.Sequential(MLP(dim, **kw), MLP(dim, **kw))


def shard_inner_then_root(model: nn.Sequential, kind: str) -> None:
    """``fully_shard`` on ``model[0]``'s two projections, then on the root (which gets
    ``model[1]``), as upstream's lazy-init tests wrap."""
    for module in (model[0].in_proj, model[0].out_proj, model):
        fully_shard(module, mp_policy=policy(kind, module, model))


def case_lazy_init_sets_the_root_and_the_fqns() -> dict[str, str]:
    out = {}
    for kind in kinds():
        model = two_mlps()
        shard_inner_then_root(model, kind)
        root = fully_shard.state(model)
        root._lazy_init()
        inner = [fully_shard.state(model[0].in_proj), fully_shard.state(model[0].out_proj)]
        assert root._is_root and not any(s._is_root for s in inner), kind
        assert root._state_ctx.all_states == [root, *inner], kind
        fqns = {
            s._fsdp_param_group._module_fqn: {p._param_fqn for p in s._fsdp_param_group.fsdp_params}
            for s in (root, *inner)
        }
        assert fqns == {
            "": {f"1.{m}.{p}" for m in ("in_proj", "out_proj") for p in ("weight", "bias")},
            "0.in_proj": {"0.in_proj.weight", "0.in_proj.bias"},
            "0.out_proj": {"0.out_proj.weight", "0.out_proj.bias"},
        }, (kind, fqns)
        out[kind] = repr(sorted((k, sorted(v)) for k, v in fqns.items()))
    return out


class WeightNorm(nn.Module):
    """Upstream's model whose root parameter is replaced after sharding, before lazy init."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Linear(3, 3, bias=False)
        self.layer2 = nn.Linear(3, 3, bias=False)
        self.weight_norm = nn.Parameter(torch.empty(3))

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return self.layer2(self.layer1(inp)).sum() + self.weight_norm.sum()


def case_a_parameter_replaced_before_lazy_init_is_resharded() -> dict[str, str]:
    out = {}
    for kind in kinds():
        with torch.device("meta"):
            model = WeightNorm()
        for module in (model.layer1, model.layer2, model):
            fully_shard(module, mp_policy=policy(kind, module, model))
        model.layer1.to_empty(device="cpu")
        model.layer2.to_empty(device="cpu")
        with seeded(1):
            for layer in (model.layer1, model.layer2):
                layer.reset_parameters()
        with torch.no_grad():  # from the sharded weights: a DTensor lazy init takes over
            norm = torch.linalg.norm(model.layer1.weight, dim=1)
            norm = norm + torch.linalg.norm(model.layer2.weight, dim=1)
        model.weight_norm = nn.Parameter(norm)
        with seeded(2):
            inp = torch.randn(3, 3)
        with CollectiveRecorder() as recorder:
            loss = model(inp).sum()
            loss.backward()
        assert isinstance(model.weight_norm, DTensor), kind
        out[kind] = state_digest(model, [loss], recorder)
    return out


def mlps(n: int = 3, dim: int = 3, multiplier: int = 3) -> nn.Sequential:
    with seeded(0):
        return nn.Sequential(*[MLP(dim, dim_multiplier=multiplier) for _ in range(n)])


def case_parameters_shard_on_dim_0_unevenly_and_shared() -> dict[str, str]:
    out = {}
    world, rank = dist.get_world_size(), dist.get_rank()
    for kind, shared in itertools.product(kinds(), (False, True)):
        model = mlps()
        if shared:
            model[0].in_proj = model[1].in_proj
        originals = [p.detach().clone() for p in model.parameters()]
        fully_shard(model, mp_policy=policy(kind, model, model))
        sharded = list(model.parameters())
        assert len(sharded) == len(originals), kind
        for original, param in zip(originals, sharded):
            assert isinstance(param, DTensor) and param.placements == (Shard(0),), kind
            assert param.size() == original.size() and param.stride() == original.stride()
            assert torch.equal(param.to_local(), torch.chunk(original, world, dim=0)[rank])
        out[kind] = out.get(kind, "") + digest(sharded)
    return out


def largest_dim(param: nn.Parameter) -> Shard:
    return Shard(max(range(param.ndim), key=lambda d: param.shape[d]))


def case_shard_placement_fn_shards_other_dims() -> dict[str, str]:
    out = {}
    for kind in kinds():
        for placement_fn in (largest_dim, lambda p: Shard(-1)):
            with seeded(42):
                model = nn.Sequential(MLP(16, dim_multiplier=2), MLP(16, dim_multiplier=2))
                inp = torch.randn(4, 16)
            reference = [p.detach().clone() for p in model.parameters()]
            for module in (*model, model):
                fully_shard(
                    module,
                    mp_policy=policy(kind, module, model, bf16, fp32),
                    shard_placement_fn=placement_fn,
                )
            # both pick dim 1 of the (16, 32) weights and dim 0 of the biases
            assert {p.placements[0].dim for p in model.parameters()} == {0, 1}, kind
            for param, ref in zip(model.parameters(), reference):
                assert torch.equal(param.full_tensor(), ref), kind
            with CollectiveRecorder() as recorder:
                loss = model(inp).sum()
                loss.backward()
            out[kind] = out.get(kind, "") + state_digest(model, [loss], recorder)
    return out


# ---------------------------------------------------------------- torch's own errors, word for word
# Each: how to get there with a policy of a kind (returns the call that raises), torch's error and
# its message; under the patch every kind must raise exactly torch's.


def _lazy_init_from_a_non_root(kind: str) -> Callable[[], object]:
    model = two_mlps()
    shard_inner_then_root(model, kind)
    fully_shard.state(model[0].in_proj)._lazy_init()
    return fully_shard.state(model)._lazy_init


def _grouped_root(kind: str) -> Callable[[], object]:
    model = two_mlps()
    fully_shard([model[0], model[1]], mp_policy=policy(kind, model[0], model))
    return fully_shard.state(model[0])._lazy_init


def _shard_dim_1(kind: str) -> Callable[[], object]:
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8))
    return lambda: fully_shard(
        model, mp_policy=policy(kind, model), shard_placement_fn=lambda p: Shard(1)
    )


def _uneven_dim_1(kind: str) -> Callable[[], object]:
    model = nn.Sequential(nn.Linear(16, 17), nn.Linear(17, 8))
    return lambda: fully_shard(model, mp_policy=policy(kind, model), shard_placement_fn=largest_dim)


def _scalar(kind: str) -> Callable[[], object]:
    model = mlps()
    model.register_parameter("scalar_p", nn.Parameter(torch.tensor(1.0)))
    return lambda: fully_shard(model, mp_policy=policy(kind, model))


def _non_contiguous(kind: str) -> Callable[[], object]:
    conv = nn.Conv2d(8, 8, 3).to(memory_format=torch.channels_last)
    return lambda: fully_shard(conv, mp_policy=policy(kind, conv))


TORCH_ERRORS: dict[str, tuple[Callable[[str], Callable[[], object]], type[Exception], str]] = {
    "lazy_init_from_a_non_root_first": (
        _lazy_init_from_a_non_root, RuntimeError, "already been lazily initialized for 0.in_proj"
    ),
    "a_grouped_call_as_root": (
        _grouped_root, RuntimeError, "FSDP requires a single root module but got"
    ),
    "an_invalid_shard_dim": (_shard_dim_1, AssertionError, "Shard dim 1 is invalid for 1D tensor"),
    "uneven_sharding_on_dim_1": (_uneven_dim_1, NotImplementedError, "uneven sharding on dim 1"),
    "a_scalar_parameter": (
        _scalar, ValueError, "Change scalar_p to a 1D tensor with numel equal to 1"
    ),
    "a_non_contiguous_parameter": (
        _non_contiguous, NotImplementedError, "does not support non-contiguous parameters"
    ),
}  # fmt: skip


def torch_s_error(
    reach: Callable[[str], Callable[[], object]], error: type[Exception], match: str
) -> dict[str, str]:
    """Every kind raises torch's own error; its message, per kind, for the comparison."""
    out = {}
    for kind in kinds():
        call = reach(kind)
        with pytest.raises(error, match=match) as caught:
            call()
        out[kind] = str(caught.value)
    return out


for _name, _error_case in TORCH_ERRORS.items():
    globals()[f"case_{_name}_is_torch_s_error"] = functools.partial(torch_s_error, *_error_case)


def case_the_old_import_path_trains() -> dict[str, str]:
    from torch.distributed._composable.fsdp import fully_shard as old_fully_shard

    out = {}
    for kind in kinds():
        with seeded(0):
            model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
        for module in (model[0], model[1], model):
            old_fully_shard(module, mp_policy=policy(kind, module, model, bf16))
        assert all(isinstance(m, FSDPModule) for m in (model[0], model[1], model))
        with seeded(1 + dist.get_rank()):
            inp = torch.randn(8, 16)
        with CollectiveRecorder() as recorder:
            loss = model(inp).sum()
            loss.backward()
        out[kind] = state_digest(model, [loss], recorder)
    return out


def case_meta_device_init_materializes_and_trains() -> dict[str, str]:
    out = {}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    const = 1337.0
    for kind, dim, mixed in itertools.product(kinds(), (8, 3, 1), (False, True)):
        dtypes = (bf16, fp32) if mixed else (None, None)
        with torch.device("meta"):
            model = nn.Sequential(
                MLP(dim, dim_multiplier=1, bias=False), MLP(dim, dim_multiplier=1, bias=False)
            )
            for module in (model[0], model[1], model):
                fully_shard(module, mesh=mesh, mp_policy=policy(kind, module, model, *dtypes))
        assert all(p.device.type == "meta" for p in model.parameters())
        model.to_empty(device="cpu")
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            tensor.detach().fill_(const)
        with seeded(0):
            for module in model.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
            inp = torch.randn(4, dim)
        for param in model.parameters():
            local = param.to_local()
            assert local.numel() == 0 or not torch.all(local == const), kind
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        with CollectiveRecorder() as recorder:
            loss = model(inp).sum()
            loss.backward()
        optim.step()
        out[kind] = out.get(kind, "") + state_digest(model, [loss], recorder)
    return out


CASES = collect_cases(globals())

globals().update(conformance_suites(2, __name__, CASES))
