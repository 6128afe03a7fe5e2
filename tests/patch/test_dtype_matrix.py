"""FSDP 1x4 and HSDP 2x2: prime dim-0 sizes across the whole mappable dtype matrix, the seed's
adversarial case as one case (M38 in ``docs/seeds.md``) and the grouped-LayerNorm parity on 4
ranks (M31).

Values are dyadic (k/8), exact in every mapped dtype, and identical on every rank, so the
expected all-gathered parameters and reduced gradients are known exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fsdp_precision as fp
from fsdp_precision import MAPPABLE_DTYPES, ParamDtypeMixedPrecisionPolicy
from fsdp_precision.testing import CollectiveRecorder

from tests.patch.test_parity import grouped_layernorms
from tests.support.harness import collect_cases, distributed_suite
from tests.support.models import bf16, fp32

DIMS = (7, 97, 101, 103)

COLS = 3


def pattern(n: int, salt: int) -> torch.Tensor:
    """(n, COLS) values k/8 with k in 1..8: exact in every float8 format too."""
    k = (torch.arange(n * COLS).reshape(n, COLS) * 5 + salt) % 8 + 1
    return k.to(fp32) / 8


class Probe(nn.Module):
    def __init__(self, n: int, salt: int, storage: torch.dtype) -> None:
        super().__init__()
        self.w = nn.Parameter(pattern(n, salt).to(storage))
        self.register_buffer("coef", pattern(n, salt + 3), persistent=False)
        self.gathered: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.gathered = self.w.detach().clone()
        return (self.w.to(fp32) * self.coef * x).sum()


class Probes(nn.Module):
    def __init__(self, storages: list[torch.dtype]) -> None:
        super().__init__()
        self.probes = nn.ModuleList(
            Probe(n, salt, s) for salt, (n, s) in enumerate(zip(DIMS + (7,), storages))
        )
        self.ints = nn.Parameter(torch.arange(5), requires_grad=False)
        self.flags = nn.Parameter(torch.tensor([True, False, True]), requires_grad=False)
        self.phase = nn.Parameter(torch.randn(4, dtype=torch.complex64), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(p(x) for p in self.probes)


def run_matrix(mesh_shape: tuple[int, ...]) -> None:
    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    shard_size = mesh_shape[-1]
    matrix = list(MAPPABLE_DTYPES)
    for offset in range(len(matrix)):
        mapped = [matrix[(offset + j) % len(matrix)] for j in range(len(DIMS))]
        # Four fp32-stored probes with mapped dtypes, one probe left unmapped: stored in bf16
        # (mixed storage).
        model = Probes([fp32] * len(DIMS) + [bf16])
        ignored = {model.ints, model.flags, model.phase}
        frozen = {n: p.detach().clone() for n, p in model.named_parameters() if p in ignored}
        dtype_map = {f"probes.{j}.w": d for j, d in enumerate(mapped)}
        policy = ParamDtypeMixedPrecisionPolicy(
            param_dtype=bf16, reduce_dtype=fp32, param_dtype_map=dtype_map
        )
        fully_shard(
            model, mesh=mesh, mp_policy=policy, reshard_after_forward=True, ignored_params=ignored
        )
        with CollectiveRecorder() as rec:
            model(torch.ones(COLS)).backward()
        computes = mapped + [bf16]
        label = f"offset {offset} mesh {mesh_shape}"
        # Forward: each parameter gathered whole, in its mapped dtype, values exact.
        for j, (probe, dtype) in enumerate(zip(model.probes, computes)):
            full = pattern(DIMS[j] if j < len(DIMS) else 7, j)
            assert probe.gathered.dtype == dtype, (label, j, probe.gathered.dtype)
            assert probe.gathered.shape == full.shape, (label, j)
            assert torch.equal(probe.gathered.to(fp32), full.to(dtype).to(fp32)), (label, j)
        # Backward: each sharded gradient is the exact mean, in the parameter's storage dtype.
        for j, probe in enumerate(model.probes):
            n = DIMS[j] if j < len(DIMS) else 7
            grad = probe.w.grad
            assert grad.dtype == probe.w.dtype, (label, j, grad.dtype)
            expected = pattern(n, j + 3).to(computes[j]).to(fp32)
            full = grad.full_tensor().to(fp32)
            assert torch.equal(full, expected.to(probe.w.dtype).to(fp32)), (label, j)
        # Ignored non-floating parameters: untouched, never sharded.
        for name, value in frozen.items():
            assert torch.equal(getattr(model, name), value), (label, name)
        # Collectives: one all-gather per unshard (forward, backward), one reduce-scatter.
        gathers = rec.of("all_gather")
        assert len(gathers) == 2, (label, gathers)
        padded = [-(-n // shard_size) * shard_size * COLS for n in DIMS + (7,)]
        expected_bytes = sum(p * d.itemsize for p, d in zip(padded, computes))
        for gather in gathers:
            assert gather.dtype == torch.uint8 and gather.group_size == shard_size
            assert gather.output_bytes == expected_bytes, (label, gather, expected_bytes)
        (rs,) = rec.of("reduce_scatter")
        assert rs.dtype == fp32 and rs.input_bytes == sum(padded) * 4, (label, rs)
        all_reduces = rec.of("all_reduce")
        assert len(all_reduces) == (1 if len(mesh_shape) == 2 else 0), (label, all_reduces)
        dist.barrier()


def case_fsdp_1x4_dtype_matrix_prime_dims() -> None:
    run_matrix((4,))


def case_hsdp_2x2_dtype_matrix_prime_dims() -> None:
    run_matrix((2, 2))


class Adversarial(Probes):
    """:class:`Probes` plus one parameter shared by two modules (``left`` and ``right``), all
    of them members of one grouped ``fully_shard`` call."""

    def __init__(self, storages: list[torch.dtype]) -> None:
        super().__init__(storages)
        self.left = Probe(SHARED, len(DIMS) + 1, fp32)
        self.right = Probe(SHARED, len(DIMS) + 2, fp32)
        self.right.w = self.left.w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.left(x) + self.right(x)


#: The shared parameter's prime dim 0.
SHARED = 11


def case_the_adversarial_case_in_one_grouped_call_under_hsdp_2x2() -> None:
    """The seed's one adversarial case, whole: a parameter shared across two modules of one
    grouped call (kept fp32 beside the others), HSDP 2x2, prime dim-0 sizes, every mappable
    dtype on the other members in turn, ignored non-floating parameters; one model-scoped
    policy on both calls. (The shared parameter stays fp32: its two gradients are summed by
    autograd in the gathered dtype, and torch has no float8 addition.)"""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    matrix = list(MAPPABLE_DTYPES)
    for offset in range(len(matrix)):
        mapped = [matrix[(offset + j) % len(matrix)] for j in range(len(DIMS))]
        model = Adversarial([fp32] * len(DIMS) + [bf16])
        ignored = {model.ints, model.flags, model.phase}
        frozen = {n: p.detach().clone() for n, p in model.named_parameters() if p in ignored}
        rules = fp.PrecisionRules(
            param_dtype=bf16,
            reduce_dtype=fp32,
            rules=(
                *(fp.Glob(f"probes.{j}.w", dtype=d, boundary="none") for j, d in enumerate(mapped)),
                fp.Glob("left.w", boundary="none"),
            ),
            hf_keep_in_fp32=False,
            advice="off",
        )
        policy = fp.model_policy(model, rules)
        group = [*model.probes, model.left, model.right]
        fully_shard(group, mesh=mesh, mp_policy=policy, ignored_params=ignored)
        fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored)
        with CollectiveRecorder() as rec:
            model(torch.ones(COLS)).backward()
        label = f"offset {offset}"
        computes = [*mapped, bf16, fp32, fp32]
        probes = [*model.probes, model.left, model.right]
        sizes = [*DIMS, 7, SHARED, SHARED]
        salts = [*range(len(DIMS) + 2), len(DIMS) + 1]  # right holds left's parameter
        for j, (probe, dtype, n) in enumerate(zip(probes, computes, sizes, strict=True)):
            full = pattern(n, salts[j])
            assert probe.gathered.dtype == dtype, (label, j, probe.gathered.dtype)
            assert torch.equal(probe.gathered.to(fp32), full.to(dtype).to(fp32)), (label, j)
        for j, probe in enumerate(model.probes):  # the mean of equal gradients: exact
            expected = pattern(sizes[j], j + 3).to(computes[j]).to(fp32)
            grad = probe.w.grad.full_tensor().to(fp32)
            assert torch.equal(grad, expected.to(probe.w.dtype).to(fp32)), (label, j)
        shared = pattern(SHARED, len(DIMS) + 4) + pattern(SHARED, len(DIMS) + 5)
        assert model.right.w is model.left.w
        assert model.left.w.grad.dtype == fp32
        assert torch.equal(model.left.w.grad.full_tensor(), shared), label  # both uses
        for name, value in frozen.items():
            assert torch.equal(getattr(model, name), value), (label, name)
        # One all-gather per unshard of the group (forward, backward), the shared parameter
        # once, in its dtype; the root manages nothing floating.
        gathers = rec.of("all_gather")
        assert len(gathers) == 2, (label, gathers)
        padded = [-(-n // 2) * 2 * COLS for n in sizes[:-1]]
        expected_bytes = sum(p * d.itemsize for p, d in zip(padded, computes[:-1], strict=True))
        for gather in gathers:
            assert gather.output_bytes == expected_bytes, (label, gather, expected_bytes)
        (rs,) = rec.of("reduce_scatter")
        assert rs.dtype == fp32 and rs.input_bytes == sum(padded) * 4, (label, rs)
        assert len(rec.of("all_reduce")) == 1, label  # across the replicas
        dist.barrier()


def on_four_ranks(mesh_shape: tuple[int, ...]) -> None:
    """``test_parity``'s grouped-LayerNorm parity on a mesh of 4 ranks (M31 in
    ``docs/seeds.md``)."""
    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    grouped_layernorms(mesh=init_device_mesh("cpu", mesh_shape, mesh_dim_names=names))


def case_grouped_layernorms_hsdp_2x2() -> None:
    on_four_ranks((2, 2))


def case_grouped_layernorms_fsdp_1x4() -> None:
    on_four_ranks((4,))


CASES = collect_cases(globals())

results, test_four_ranks = distributed_suite(4, __name__, CASES)
