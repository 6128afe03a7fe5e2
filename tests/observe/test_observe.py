"""``fsdp_precision.testing``: the observers and typed results themselves, on two gloo ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule, fully_shard

import fsdp_precision._plan.build as build_module
import fsdp_precision._verify.reference as reference_module
from fsdp_precision import (
    ParamDtypeMixedPrecisionPolicy,
    PrecisionPlan,
    PrecisionRules,
    compile_param_dtype_maps,
)
from fsdp_precision._releases import release_traits, v2_13, v2_15
from fsdp_precision.testing import (
    CollectiveRecorder,
    GatherProbe,
    ParityReport,
    gather_across_ranks,
    verify_parity,
)

from tests.support.harness import collect_cases, distributed_suite

bf16, fp32 = torch.bfloat16, torch.float32


@dataclass(frozen=True)
class _Record:
    rank: int
    values: tuple[float, ...]


def case_gather_across_ranks_returns_every_rank_typed_in_rank_order() -> None:
    mine = _Record(dist.get_rank(), (float(dist.get_rank()), 0.5))
    everyone = gather_across_ranks(mine)
    assert everyone == [_Record(r, (float(r), 0.5)) for r in range(dist.get_world_size())]
    assert everyone[dist.get_rank()] == mine


class _Functional(nn.Module):
    """The root reads ``head.weight`` itself: ``head``'s own forward never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.block(x).float(), self.head.weight)


def case_probe_reads_every_parameter_its_unit_holds() -> None:
    model = _Functional()
    policy = ParamDtypeMixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    fully_shard(model.block, mp_policy=policy)
    mapped = ParamDtypeMixedPrecisionPolicy(
        param_dtype=bf16, reduce_dtype=fp32, param_dtype_map={"head.weight": fp32}
    )
    fully_shard(model, mp_policy=mapped)
    with GatherProbe(model) as probe:
        model(torch.randn(3, 8)).sum().backward()
    # Seen at the root unit's pre-forward, unsharded, though no module forward reads it (a probe
    # hooked on each module's own forward would miss it).
    head = probe.seen["head.weight"]
    assert (head.unit, head.dtype, head.shape, head.numel, head.sharded) == (
        "",
        fp32,
        (4, 8),
        32,
        False,
    )
    assert probe.by_unit() == {"block": {bf16: 72}, "": {fp32: 32}}
    model(torch.randn(3, 8))  # removed on exit: nothing more is recorded
    assert set(probe.seen) == {"head.weight", "block.weight", "block.bias"}


class _PerturbedOnRank1(nn.Module):
    """Negative control: only rank 1's wrapped model adds 1 to its output."""

    def __init__(self, perturb: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.perturb = perturb

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x)
        if self.perturb and dist.get_rank() == 1 and isinstance(self, FSDPModule):
            out = out + 1
        return out


def case_verify_reports_the_worst_rank_on_every_rank() -> None:
    for perturb in (False, True):
        torch.manual_seed(0)
        model = _PerturbedOnRank1(perturb)
        plan = compile_param_dtype_maps(model, PrecisionRules(), [model])
        inputs = {"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(0))}
        report = verify_parity(plan, inputs)
        # Rank 0's own output and loss match; the report still holds rank 1's mismatch.
        assert report.ok is not perturb, report.format()
        assert report.loss_match is not perturb and report.output_match is not perturb


class _GradDtypes(nn.Module):
    """Each way a bf16 compute weight's gradient can leave autograd: a fused ``rms_norm``
    kernel (its weight gradient comes out in fp32), a bf16 weight scaling fp32 activations
    (GPT-OSS's norm), a broadcast weight used twice (RWKV's ``time_mix``), and a tied weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.norm = nn.RMSNorm(16)
        self.scale = nn.Parameter(torch.rand(16) + 0.5)
        self.mix = nn.Parameter(torch.rand(1, 1, 16))
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(ids))
        h = (self.scale * h.float()).to(h.dtype)
        h = self.mix * h + (1 - self.mix) * h.roll(1, dims=1)
        return self.head(h)


def _grad_dtype_report(
    reduce_dtype: torch.dtype | None,
    *,
    defers: bool | None = None,
    promotes: bool | None = None,
) -> tuple[PrecisionPlan, ParityReport]:
    """``verify_parity`` of :class:`_GradDtypes` computing in bf16 (stored in fp32). ``defers``
    forces the reference's rule for where autograd leaves a gradient, ``promotes`` the plan's
    reduce dtype for ``reduce_dtype=None`` (``None``: the installed release's rule)."""
    forced = []
    if defers is not None:  # 2.15 defers the upcast, 2.13 does not
        forced.append((reference_module, v2_15.TRAITS if defers else v2_13.TRAITS))
    if promotes is not None:  # 2.15 promotes reduce_dtype=None, 2.13 does not
        forced.append((build_module, v2_15.TRAITS if promotes else v2_13.TRAITS))
    saved = [(module, module.release_traits) for module, _ in forced]
    for module, traits in forced:
        module.release_traits = lambda traits=traits: traits  # type: ignore[misc]
    try:
        torch.manual_seed(0)
        model = _GradDtypes()
        rules = PrecisionRules(param_dtype=bf16, reduce_dtype=reduce_dtype)
        plan = compile_param_dtype_maps(model, rules, [model])
        ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
        return plan, verify_parity(plan, {"ids": ids})
    finally:
        for module, original in saved:
            module.release_traits = original  # type: ignore[method-assign]


def _off(report: ParityReport) -> set[str]:
    return {p.fqn for p in report.params if p.grad is not None and not p.grad.bitwise}


def case_reference_leaves_gradients_where_the_release_does() -> None:
    # 2.15 clears grad_dtype for the backward, so the fused kernel's fp32 weight gradient is
    # reduced as it is; earlier releases cast it to bf16 first (ReleaseTraits.defers_grad_upcast).
    _, report = _grad_dtype_report(fp32)
    assert report.ok, report.format()
    # Negative control: the other release's rule puts the norm's and the scale's gradients off
    # by a bf16 rounding, while the twice-used and the tied weights (summed in bf16 either way)
    # still agree.
    _, flipped = _grad_dtype_report(fp32, defers=not release_traits().defers_grad_upcast)
    assert _off(flipped) == {"norm.weight", "scale"}, flipped.format()


def case_reduce_dtype_none_is_planned_as_the_release_reduces() -> None:
    # reduce_dtype=None: 2.15 reduces in the promotion of the gradients' dtypes (fp32 here),
    # earlier releases in the compute dtype (bf16). The plan says so, and the reference follows.
    promotes = release_traits().mixed_dtype_reduce
    plan, report = _grad_dtype_report(None)
    assert report.ok, report.format()
    assert {p.reduce for u in plan.units for p in u.params} == {fp32 if promotes else bf16}
    if promotes:
        # Negative control (2.15): planned as before 2.15, the norm's and the scale's fp32
        # gradients, which FSDP reduces unrounded, would be rounded to bf16.
        _, flipped = _grad_dtype_report(None, promotes=False)
        assert _off(flipped) == {"norm.weight", "scale"}, flipped.format()


def case_recorder_reads_each_functional_collectives_group() -> None:
    """DTensor's functional collectives, each with its group where its signature puts it (a
    reduce-scatter's after the scatter dim): kind, dtype, bytes and group size recorded."""
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD
    x = torch.ones(4, 3, dtype=bf16)
    with CollectiveRecorder() as rec:
        funcol.all_gather_tensor(x, 0, group).wait()
        funcol.reduce_scatter_tensor(x, "sum", 0, group).wait()
        funcol.all_reduce(x.float(), "sum", group=group).wait()
    calls = [(c.kind, c.dtype, c.input_bytes, c.group_size, c.functional) for c in rec.calls]
    assert calls == [
        ("all_gather", bf16, 24, 2, True),
        ("reduce_scatter", bf16, 24, 2, True),
        ("all_reduce", fp32, 48, 2, True),
    ], calls
    assert rec.of("all_gather") == [] and len(rec.of("all_gather", functional=True)) == 1


CASES = collect_cases(globals())

results, test_two_ranks = distributed_suite(2, __name__, CASES)
