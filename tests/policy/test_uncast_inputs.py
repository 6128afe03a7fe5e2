"""Inputs that keep their precision across a unit boundary (``uncast_inputs``): a timestep
embedding computed in fp32 reaches every block unit in fp32, as in the unsharded model, through
every path (a per-call policy, ``model_policy``, plans in both layouts,
``wrap_model_for_training``); every other floating input is cast as FSDP casts it. The control
is the same wrap without the names: the embedding arrives rounded to bf16. One gloo rank."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import fsdp_precision as fp

pytestmark = pytest.mark.usefixtures("world1")
bf16, fp32 = torch.bfloat16, torch.float32


class Block(nn.Module):
    """Upcasts ``temb`` itself, as Wan's block does (``scale_shift_table + temb.float()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(16) / 4)
        self.lin = nn.Linear(16, 16)
        self.seen: dict[str, torch.dtype] = {}

    def forward(self, hidden: torch.Tensor, temb: torch.Tensor, *, scale: torch.Tensor):
        self.seen = {"hidden": hidden.dtype, "temb": temb.dtype, "scale": scale.dtype}
        shift = (self.table + temb.float()).to(hidden.dtype)
        return self.lin(hidden + shift) * scale


class Model(nn.Module):
    """A time embedder kept in fp32 (its own rule), two blocks, a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.time = nn.Linear(1, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        temb = self.time(t.float())
        scale = torch.ones_like(x)
        for i, block in enumerate(self.blocks):
            # positional temb into one block, by keyword into the other
            x = block(x, temb, scale=scale) if i == 0 else block(x, temb=temb, scale=scale)
        return self.head(x)


def rules(*uncast: str) -> fp.PrecisionRules:
    return fp.PrecisionRules(
        param_dtype=bf16,
        reduce_dtype=fp32,
        uncast_inputs=uncast,
        rules=(fp.Glob("time.*", boundary="none"),),
    )


def per_call(model: Model, r: fp.PrecisionRules) -> None:
    policy = fp.ParamDtypeMixedPrecisionPolicy(
        param_dtype=bf16, reduce_dtype=fp32, uncast_inputs=r.uncast_inputs
    )
    root = fp.ParamDtypeMixedPrecisionPolicy(
        param_dtype=bf16,
        reduce_dtype=fp32,
        param_dtype_map={"time.weight": fp32, "time.bias": fp32},
    )
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=root)


def by_policy(model: Model, r: fp.PrecisionRules) -> None:
    policy = fp.model_policy(model, r)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def by_plan(layout: str) -> Callable[[Model, fp.PrecisionRules], None]:
    def wrap(model: Model, r: fp.PrecisionRules) -> None:
        plan = fp.compile_param_dtype_maps(model, r, [*model.blocks, model], layout=layout)
        by_name = {u.name: u.uncast_inputs for u in plan.units}
        want = frozenset(r.uncast_inputs)
        assert by_name["blocks.0"] == by_name["blocks.1"] == want, by_name
        assert not by_name["<root>"] and not by_name.get("time")  # take no temb
        plan.apply()

    return wrap


def by_wrap(model: Model, r: fp.PrecisionRules) -> None:
    config = fp.DistributedConfig(
        fsdp_mixed_precision=r,
        fsdp_auto_wrap_policy="transformer_block",
        fsdp_transformer_block_classes=("Block",),
    )
    fp.wrap_model_for_training(model, config)


PATHS = {
    "per_call_policy": per_call,
    "model_policy": by_policy,
    "plan_in_unit": by_plan("in_unit"),
    "plan_separate_units": by_plan("separate_units"),
    "wrap_model_for_training": by_wrap,
}


def run(model: Model) -> torch.Tensor:
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([[998.39], [937.0], [1.5]])
    out = model(x, t)
    out.float().sum().backward()
    return out


@pytest.mark.parametrize("path", PATHS)
def test_named_inputs_keep_their_dtype_into_every_unit(path: str) -> None:
    model = Model()
    PATHS[path](model, rules("temb"))
    run(model)
    for block in model.blocks:
        assert block.seen == {"hidden": bf16, "temb": fp32, "scale": bf16}, (path, block.seen)
    assert model.blocks[0].table.grad is not None and model.time.weight.grad is not None


@pytest.mark.parametrize("path", PATHS)
def test_without_the_names_the_unit_rounds_them(path: str) -> None:
    model = Model()
    PATHS[path](model, rules())
    run(model)
    for block in model.blocks:
        assert block.seen == {"hidden": bf16, "temb": bf16, "scale": bf16}, (path, block.seen)


def test_the_names_change_the_numbers_as_the_unsharded_model_has_them() -> None:
    """The reference keeps ``temb`` as the model made it: the wrapped model with the names
    matches it bitwise; without them it does not (998.39 rounds to 1000 in bf16)."""
    from fsdp_precision._verify.reference import Reference

    outs = {}
    for names in (("temb",), ()):
        model = Model()
        plan = fp.compile_param_dtype_maps(model, rules(*names), [*model.blocks, model])
        reference = Reference(plan)
        expected = run(reference.module)  # type: ignore[arg-type]
        plan.apply()
        outs[names] = run(model)
        assert torch.equal(outs[names], expected), names
    assert not torch.equal(outs[("temb",)], outs[()])


def test_bad_names_are_refused_with_the_value() -> None:
    with pytest.raises(ValueError, match=r"PrecisionRules.uncast_inputs must be a collection"):
        fp.PrecisionRules(uncast_inputs="temb")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"argument names \(identifiers\), got 'temb\.x'"):
        fp.ParamDtypeMixedPrecisionPolicy(uncast_inputs=("temb.x",))
    assert fp.PrecisionRules(uncast_inputs=["temb", "temb"]).uncast_inputs == ("temb",)


def test_the_trace_lists_the_inputs_a_unit_rounds_and_suggests_the_wide_ones() -> None:
    from fsdp_precision._verify.trace import trace_compute_dtypes

    inputs = (torch.randn(3, 16), torch.tensor([[998.39], [937.0], [1.5]]))
    for names in ((), ("temb",)):
        model = Model()
        plan = fp.compile_param_dtype_maps(model, rules(*names), [*model.blocks, model])
        trace = trace_compute_dtypes(plan, inputs)
        assert trace.ok, trace.error
        seen = {(r.unit, r.argument): r for r in trace.rounded_inputs}
        # fp32 temb from the kept time embedder into each block; the model's own fp32 inputs
        # into the root unit (not suggested: the caller chose their dtype)
        assert set(seen) == {
            ("blocks.0", "temb"),
            ("blocks.1", "temb"),
            ("<root>", "x"),
            ("<root>", "t"),
        }
        temb = seen[("blocks.0", "temb")]
        assert (temb.producer, temb.dtype, temb.cast_to) == ("time", "float32", "bfloat16")
        assert temb.suggested and temb.uncast == bool(names)
        assert (
            not seen[("<root>", "x")].suggested
            and seen[("<root>", "x")].producer == "<model input>"
        )
        assert trace.suggested_uncast() == (() if names else ("temb",))
    # hidden states and the bf16 scale are produced in bf16: nothing to round, not listed
