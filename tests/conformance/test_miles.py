"""Miles' own edge cases, with Miles' semantics: one policy passed to every call (a call that
manages no parameter maps nothing), 0-size trainable parameters in a mixed unit, ``None`` as an
empty map, and compiled maps that leave out what changes nothing (entries equal to the unit's
compute dtype; every alias but the first name of a shared parameter). On 4 ranks, as Miles ran
them; the single-process facts in the test process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import fsdp_precision as fp
from fsdp_precision import Glob, ModuleClass, PrecisionRules, compile_param_dtype_maps
from fsdp_precision.testing import CollectiveRecorder, GatherProbe, verify_parity

from tests.support.harness import distributed_suite
from tests.support.models import Net, bf16, fp32, train_in_lockstep


def mapped(dtype_map: dict[str, torch.dtype] | None) -> fp.ParamDtypeMixedPrecisionPolicy:
    return fp.ParamDtypeMixedPrecisionPolicy(
        param_dtype=bf16, reduce_dtype=fp32, param_dtype_map=dtype_map
    )


# ------------------------------------------------------------------ one policy on every call


class Routed(nn.Module):
    """A bf16 projection beside a router that casts its input to its own weight's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.router = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return h * self.router(h.to(self.router.weight.dtype)).softmax(-1).sum(-1, keepdim=True)


def case_a_map_on_a_call_that_manages_no_parameter_maps_nothing() -> None:
    """Miles' layout: the same policy on the block and on the root, which manages nothing."""
    torch.manual_seed(0)
    policy = mapped({"router.weight": fp32, "router.bias": fp32})
    net = nn.Sequential(Routed())
    fully_shard(net[0], mp_policy=policy)
    fully_shard(net, mp_policy=policy)  # the root manages no parameter: accepted
    with GatherProbe(net) as probe:
        net(torch.randn(2, 8)).float().sum().backward()
    assert probe.seen["0.router.weight"].dtype == fp32 and probe.seen["0.proj.weight"].dtype == bf16
    # A key that names no parameter under a call that manages none, relative to any module,
    # is a typo nothing else would report: warned, with a did-you-mean.
    typo = mapped({"router.weigth": fp32})
    lone = nn.Sequential(Routed())
    fully_shard(lone[0], mp_policy=MixedPrecisionPolicy(param_dtype=bf16))
    with pytest.warns(
        UserWarning,
        match=r"\['router\.weigth'\] name no parameter under it \(did you mean '0\.router\.weight'\?\)",
    ):
        fully_shard(lone, mp_policy=typo)
    # Control: a call that does manage parameters still refuses a key that names none of them.
    other = nn.Sequential(Routed(), nn.Linear(8, 8))
    fully_shard(other[0], mp_policy=policy)
    with pytest.raises(
        fp.ParamDtypeMapError, match=r"'router\.weight' matches no parameter .*'1\.weight'"
    ):
        fully_shard(other, mp_policy=policy)


# ------------------------------------------------------------------ 0-size trainable parameters


class WithEmpty(nn.Module):
    """A mixed unit (fp32 norm, bf16 linear) holding a trainable 0-size parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.empty = nn.Parameter(torch.zeros(0, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x)) + self.empty.sum()


def _with_empty_plan() -> fp.PrecisionPlan:
    torch.manual_seed(0)
    model = WithEmpty()
    return compile_param_dtype_maps(
        model, PrecisionRules(rules=(ModuleClass(nn.LayerNorm),)), [model]
    )


def case_a_zero_size_trainable_parameter_reduces_in_a_mixed_unit() -> None:
    plan = _with_empty_plan()
    assert plan.units[0].param_dtype_map == {"norm.weight": fp32, "norm.bias": fp32}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    report = verify_parity(plan, {"x": x})
    assert report.ok, report.problems()
    grad = plan.model.empty.grad
    assert isinstance(grad, DTensor) and grad.shape == (0, 2) and grad.dtype == fp32


@contextlib.contextmanager
def _copy_in_without_the_empty_filter() -> Iterator[None]:
    """The reduce-scatter copy-in as it was: every gradient of a run to chunk_cat."""
    from fsdp_precision._patch import reduce as _reduce

    def copy_in(grads, columns, rows, world_size):  # type: ignore[no-untyped-def]
        column = 0
        for start, stop in _reduce._runs([g.dtype for g in grads]):
            width = sum(columns[start:stop])
            out = rows if width == rows.size(1) else rows[:, column : column + width]
            torch.ops.fsdp.chunk_cat(grads[start:stop], dim=0, num_chunks=world_size, out=out)
            column += width

    original = _reduce._copy_in
    _reduce._copy_in = copy_in
    try:
        yield
    finally:
        _reduce._copy_in = original


def case_negative_control_the_unfiltered_copy_in_fails_on_the_zero_size_gradient() -> None:
    from fsdp_precision._releases import release_traits

    if release_traits().mixed_dtype_reduce:
        pytest.skip("torch 2.15 reduces mixed units with its own foreach_reduce")
    plan = _with_empty_plan()
    plan.apply()
    with _copy_in_without_the_empty_filter():
        loss = plan.model(torch.randn(4, 8)).float().sum()
        with pytest.raises(RuntimeError, match="expects non-empty tensor"):
            loss.backward()
    dist.barrier()


# ------------------------------------------------------------------ compiled maps


def _norms_plan(dtype: torch.dtype, model: nn.Module) -> fp.PrecisionPlan:
    units = [*model.blocks, model]
    return compile_param_dtype_maps(
        model, PrecisionRules(rules=(Glob("*norm.weight", dtype),)), units
    )


def case_a_rule_equal_to_the_compute_dtype_takes_torchs_exact_path() -> None:
    """``Glob('*norm.weight', bf16)`` under a bf16 policy changes nothing: the maps are empty,
    and training (outputs, gradients, parameters, collectives) is bitwise the plain policy's."""
    torch.manual_seed(0)
    ours, plain = Net(), Net()
    plain.load_state_dict(ours.state_dict())
    plan = _norms_plan(bf16, ours)
    assert all(type(u.policy) is MixedPrecisionPolicy for u in plan.units)
    plan.apply()
    reference = compile_param_dtype_maps(plain, PrecisionRules(), [*plain.blocks, plain])
    reference.apply()
    records = []
    for model in (ours, plain):
        with CollectiveRecorder() as recorder:
            model(torch.randn(4, 16)).float().pow(2).mean().backward()
        records.append([(c.kind, c.dtype, c.input_bytes) for c in recorder.calls])
        model.zero_grad()
    assert records[0] == records[1]
    train_in_lockstep([ours, plain], steps=2)


def test_a_rule_equal_to_the_compute_dtype_is_left_out_of_the_maps_but_explained() -> None:
    plan = _norms_plan(bf16, Net())
    assert [u.param_dtype_map for u in plan.units] == [{}, {}, {}]
    assert not any(p.mapped for u in plan.units for p in u.params)
    text = plan.explain()
    assert "glob '*norm.weight': 3 parameters" in text
    assert "blocks.0.norm.weight" in text and "by glob '*norm.weight'" in text
    # Control: the same rule asking for fp32 is an entry.
    kept = _norms_plan(fp32, Net())
    assert kept.units[0].param_dtype_map == {"norm.weight": fp32}


def test_entries_stay_where_the_unit_mixes_trainable_storage_dtypes() -> None:
    """A bf16 model with fp32 gates and ``param_dtype=None``: the fp32 rule matches the gates'
    storage, but torch's path refuses a unit of mixed storage, so the entries make it mapped."""
    model = Net().to(bf16)
    for block in model.blocks:
        block.gate.float()
    rules = PrecisionRules(param_dtype=None, rules=(Glob("*gate.weight"),))
    plan = compile_param_dtype_maps(model, rules, [*model.blocks, model])
    assert plan.units[0].param_dtype_map == {"gate.weight": fp32}
    # Control: stored uniformly in fp32, the same rule changes nothing.
    stored_fp32 = Net()
    uniform = compile_param_dtype_maps(stored_fp32, rules, [*stored_fp32.blocks, stored_fp32])
    assert all(not u.param_dtype_map for u in uniform.units)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # casts to each weight's dtype
        h = self.body(self.emb(ids).to(self.body.weight.dtype))
        return self.head(h.to(self.head.weight.dtype))


@pytest.mark.usefixtures("world1")
def test_a_shared_parameter_gets_one_canonical_entry_and_both_aliases_gather_it() -> None:
    model = Tied()
    plan = compile_param_dtype_maps(
        model, PrecisionRules(rules=(ModuleClass(nn.Embedding),)), [model]
    )
    assert plan.units[0].param_dtype_map == {"emb.weight": fp32}  # not head.weight too
    policy = fp.model_policy(Tied(), PrecisionRules(rules=(Glob("head.weight"),)))
    assert dict(policy.param_dtype_map) == {"emb.weight": fp32}  # root-relative, canonical
    plan.apply()
    with GatherProbe(model) as probe:
        model(torch.tensor([[1, 2, 3]]))
    assert probe.seen["emb.weight"].dtype == fp32 and probe.seen["head.weight"].dtype == fp32
    assert probe.seen["body.weight"].dtype == bf16


# ------------------------------------------------------------------ None is an empty map


def test_none_is_an_empty_map() -> None:
    assert mapped(None).param_dtype_map == {} == mapped({}).param_dtype_map
    assert mapped(None) == mapped({})
    from fsdp_precision._policy.refusals import needs_resolution

    assert not needs_resolution(mapped(None))  # torch's exact path


CASES = [
    "case_a_map_on_a_call_that_manages_no_parameter_maps_nothing",
    "case_a_zero_size_trainable_parameter_reduces_in_a_mixed_unit",
    "case_negative_control_the_unfiltered_copy_in_fails_on_the_zero_size_gradient",
    "case_a_rule_equal_to_the_compute_dtype_takes_torchs_exact_path",
]
results, test_four_ranks = distributed_suite(4, __name__, CASES)
