"""Property-based tests (hypothesis): generated module trees (nesting, a tie across modules,
prime-sized, 0-dim and 0-size parameters, frozen parameters, integer buffers and parameters),
generated unit groupings and generated maps, valid and invalid, in one process (gloo).

Invariants:

- a map the library refuses raises a named ``ParamDtypeMapError`` before anything is sharded,
  and leaves no ``DTensor`` behind (the model exactly as it was);
- a plan it accepts trains one AdamW step bitwise like the separate-units layout (where that
  layout can express it), with the uniform policy's all-gathers and reduce-scatters.

The default example count keeps CI in seconds; ``HYPOTHESIS_PROFILE=long`` runs thousands
(docs/testing.md has the figures of a long run).
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import fsdp_precision as fp
from fsdp_precision.testing import CollectiveRecorder

from tests.support.models import bf16, fp16, fp32, local

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed")
st = hypothesis.strategies

hypothesis.settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True, database=None
)
hypothesis.settings.register_profile(
    "long", max_examples=2000, deadline=None, derandomize=False, database=None,
    suppress_health_check=list(hypothesis.HealthCheck),
)  # fmt: skip
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

pytestmark = pytest.mark.usefixtures("world1")

D = 8
#: Odd and prime dimensions (Miles' test plan), a 0-dim and a 0-size parameter.
SHAPES = [(7,), (97,), (101,), (7, 5), (3, 103), (D,), (), (0, 3)]
DTYPES = [fp32, fp16, bf16, torch.float64]


@dataclass(frozen=True)
class Spec:
    """A generated model: leaves of (shape, frozen) parameters, some under a container, maybe a
    tie (leaf 1 registers leaf 0's first parameter), maybe integer state."""

    leaves: tuple[tuple[tuple[tuple[int, ...], bool], ...], ...]
    nested: tuple[bool, ...]
    tie: bool
    int_buffer: bool
    int_param: bool


class Leaf(nn.Module):
    def __init__(self, params: tuple[tuple[tuple[int, ...], bool], ...], seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        for i, (shape, frozen) in enumerate(params):
            data = torch.randn(shape, generator=g) * 0.1
            self.register_parameter(f"p{i}", nn.Parameter(data, requires_grad=not frozen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for p in self._parameters.values():
            if p is None or not p.is_floating_point():
                continue
            flat = p.to(x.dtype).reshape(-1)
            x = x + torch.tanh(flat).sum() * 0.01 * x  # every element of every parameter used
            if flat.numel() >= D:
                x = x * (1 + flat[:D] * 0.1)
        return x


class Container(nn.Module):
    def __init__(self, leaf: Leaf) -> None:
        super().__init__()
        self.inner = leaf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class Tree(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        leaves = [Leaf(params, seed=i) for i, params in enumerate(spec.leaves)]
        if spec.tie and len(leaves) > 1 and leaves[0]._parameters:
            leaves[1].register_parameter("tied", leaves[0]._parameters["p0"])
        self.blocks = nn.ModuleList(
            Container(leaf) if nested else leaf for leaf, nested in zip(leaves, spec.nested)
        )
        if spec.int_buffer:
            self.register_buffer("positions", torch.arange(D))
        if spec.int_param:
            self.step_count = nn.Parameter(torch.zeros(1, dtype=torch.int64), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    n = draw(st.integers(1, 3))
    param = st.tuples(st.sampled_from(SHAPES), st.booleans())
    leaves = tuple(tuple(draw(st.lists(param, min_size=1, max_size=3))) for _ in range(n))
    nested = tuple(draw(st.booleans()) for _ in range(n))
    return Spec(leaves, nested, draw(st.booleans()), draw(st.booleans()), draw(st.booleans()))


def _fqns(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters(remove_duplicate=False)]


def _untouched(model: nn.Module, before: dict[str, torch.dtype]) -> None:
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    assert {n: p.dtype for n, p in model.named_parameters()} == before


@hypothesis.given(spec=specs(), data=st.data())
def test_a_map_is_refused_before_anything_is_sharded_or_trains_like_separate_units(
    spec: Spec, data: st.DataObject
) -> None:
    model = Tree(spec)
    names = [n for n in _fqns(model) if n != "step_count"] + ["step_count"] * spec.int_param
    keys = data.draw(st.lists(st.sampled_from(names), max_size=4, unique=True), label="keys")
    rules = tuple(fp.Glob(k, data.draw(st.sampled_from(DTYPES), label=k)) for k in keys)
    grouped = data.draw(st.booleans(), label="a unit per block")
    units = [*model.blocks, model] if grouped else [model]
    ignored = {model.step_count} if spec.int_param else set()
    before = {n: p.dtype for n, p in model.named_parameters()}
    reference = copy.deepcopy(model)
    precision = fp.PrecisionRules(rules=rules, advice="off")
    try:
        plan = fp.compile_param_dtype_maps(model, precision, units)
        plan.apply(ignored_params=ignored)
    except fp.ParamDtypeMapError:
        _untouched(model, before)  # refused before anything was sharded
        return
    ref_units = [*reference.blocks, reference] if grouped else [reference]
    try:
        separate = fp.compile_param_dtype_maps(
            reference, precision, ref_units, layout="separate_units"
        )
        separate.apply(ignored_params={reference.step_count} if spec.int_param else set())
    except fp.ParamDtypeMapError:
        separate = None  # a layout separate units cannot express: train ours alone
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(0))
    plain = _plain_run(spec, grouped, x)
    try:
        with CollectiveRecorder() as ours:
            loss = _step(model, x)
    except RuntimeError as exc:  # what torch's own FSDP cannot train either
        assert isinstance(plain, str) and str(exc) == plain, (exc, plain)
        return
    if isinstance(plain, CollectiveRecorder):  # the uniform policy's collectives
        for kind in ("all_gather", "reduce_scatter"):
            assert ours.count(kind) == plain.count(kind), (kind, ours.calls, plain.calls)
    if separate is None:
        assert torch.isfinite(loss)
        return
    try:
        ref_loss = _step(reference, x)
    except RuntimeError as exc:  # torch's own FSDP cannot train that layout (a 0-size
        assert "_chunk_cat expects non-empty tensor" in str(exc)  # parameter in a plain unit)
        return
    assert torch.equal(loss, ref_loss), "loss differs from separate units"
    for module in (*model.modules(), *reference.modules()):  # units kept unsharded by a
        if isinstance(module, FSDPModule):  # forward without backward (all frozen) reshard
            module.reshard()
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(local(a), local(b)), f"{name} differs after the step"  # type: ignore[arg-type]


def _step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    trainable = [p for p in model.parameters() if p.requires_grad]
    out = model(x).float().pow(2).mean()
    if trainable:
        out.backward()
        torch.optim.AdamW(trainable, lr=1e-2).step()
    return out.detach()


def _plain_run(spec: Spec, grouped: bool, x: torch.Tensor) -> CollectiveRecorder | str | None:
    """The same tree under torch's plain uniform policy: its step's collectives, or the error
    torch's own FSDP raises for it (a 0-size trainable parameter: "_chunk_cat expects non-empty
    tensor"), or None when it cannot even wrap it."""
    plain = Tree(spec)
    policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    scalars = {p for p in plain.parameters() if p.dim() == 0}  # the plan replicates them too
    if spec.int_param:
        scalars.add(plain.step_count)
    try:
        for unit in [*plain.blocks, plain] if grouped else [plain]:
            fully_shard(unit, mp_policy=policy, ignored_params=scalars)
    except (ValueError, AssertionError):
        return None
    try:
        with CollectiveRecorder() as recorder:
            _step(plain, x)
    except RuntimeError as exc:
        return str(exc)
    return recorder


@hypothesis.given(spec=specs(), data=st.data())
def test_invalid_keys_are_named_and_nothing_is_sharded(spec: Spec, data: st.DataObject) -> None:
    model = Tree(spec)
    names = _fqns(model)
    name = data.draw(st.sampled_from(names))
    bad = data.draw(st.sampled_from([name + "x", name[:-1] + "?", "missing." + name, name.upper()]))
    hypothesis.assume(bad not in names)
    before = {n: p.dtype for n, p in model.named_parameters()}
    ignored = {p for p in model.parameters() if p.dim() == 0 or not p.is_floating_point()}
    hypothesis.assume(set(model.parameters()) - ignored)  # a call managing none maps nothing
    # a ParamDtypeMapError at fully_shard, or (a wildcard) a ValueError building the policy
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        policy = fp.ParamDtypeMixedPrecisionPolicy(bf16, fp32, param_dtype_map={bad: fp32})
        fully_shard(model, mp_policy=policy, ignored_params=ignored)
    _untouched(model, before)


def test_a_unit_whose_module_is_kept_whole_computes_as_a_unit_of_that_dtype() -> None:
    # Found by the property above: the root's one parameter kept in fp32, the root a unit. A
    # boundary cast on the unit's own module saw the caller's fp32 input and cast the output
    # back to fp32, where the separate unit (FSDP's casts) returns bf16. Now the unit is
    # planned as one of fp32 (FSDP casts in and out), bitwise the separate-units layout.
    spec = Spec(leaves=((((7,), False),),), nested=(False,), tie=False, int_buffer=False,
                int_param=False)  # fmt: skip
    rules = fp.PrecisionRules(rules=(fp.Glob("blocks.0.p0"),), advice="off")
    ours, reference = Tree(spec), Tree(spec)
    plan = fp.compile_param_dtype_maps(ours, rules, [ours])
    (unit,) = plan.units
    assert (unit.policy.param_dtype, unit.policy.output_dtype) == (fp32, bf16)
    assert not unit.param_dtype_map and not plan.module_casts
    plan.apply()
    fp.compile_param_dtype_maps(reference, rules, [reference], layout="separate_units").apply()
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(0))
    out, ref = ours(x), reference(x)
    assert out.dtype == ref.dtype == bf16 and torch.equal(out, ref)
