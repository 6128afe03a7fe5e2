"""Every refusal of a plan leaves the model untouched: no unit made, no parameter sharded or
cast, no hook added, whether the refusal comes at compile time or from the checks ``apply``
runs before its first ``fully_shard`` call. One case per refusal, one gloo rank."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import fsdp_precision as fp
from fsdp_precision._releases import release_traits

from tests.plan.test_separate import M

pytestmark = pytest.mark.usefixtures("world1")
bf16, fp32 = torch.bfloat16, torch.float32


class Root(nn.Module):
    """A kept parameter directly on the root, beside a bf16 linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.ones(8))
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class Experts(nn.Module):
    """Kept parameters in a ParameterList nobody calls."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.experts = nn.ParameterList([nn.Parameter(torch.ones(8)) for _ in range(2)])
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.experts[0] * self.experts[1]


def rules(*globs: str, reduce_dtype: torch.dtype | None = fp32) -> fp.PrecisionRules:
    return fp.PrecisionRules(
        param_dtype=bf16,
        reduce_dtype=reduce_dtype,
        rules=tuple(fp.Glob(g, boundary="none") for g in globs),
    )


def separate(model: nn.Module, r: fp.PrecisionRules, units: list) -> None:
    fp.compile_param_dtype_maps(model, r, units, layout="separate_units").apply()


def in_unit(model: nn.Module, r: fp.PrecisionRules, units: list) -> None:
    fp.compile_param_dtype_maps(model, r, units).apply()


def grad_dtype_on_root(model: nn.Module) -> None:
    """The root's own ``b.weight`` (bf16) asks for fp32 gradients: checked before the inner
    units are wrapped."""
    in_unit(model, rules(), [model.a, model.k, model])


@dataclass(frozen=True)
class Refusal:
    make: Callable[[], nn.Module]
    refuse: Callable[[nn.Module], None]
    match: str
    runs: bool = True


REFUSALS = {
    "a module owns a kept parameter beside others": Refusal(
        M, lambda m: separate(m, rules("k.scale"), [m.k.inner, m]), "module 'k' owns kept"
    ),
    "a kept parameter directly on the root": Refusal(
        Root, lambda m: separate(m, rules("scale"), [m]), "sits directly on the root"
    ),
    "kept parameters in a container nobody calls": Refusal(
        Experts, lambda m: separate(m, rules("experts.*"), [m]), "container 'experts'"
    ),
    "a grouped call mixes kept and other modules": Refusal(
        M, lambda m: separate(m, rules("k.*"), [[m.a, m.k], m]), "grouped unit"
    ),
    "an order fully_shard cannot take": Refusal(
        M, lambda m: in_unit(m, rules(), [m.k, m.k.inner, m]), "is planned after unit k"
    ),
    "mixed compute dtypes in a unit with reduce_dtype None": Refusal(
        M,
        lambda m: in_unit(m, rules("k.scale", reduce_dtype=None), [m.a, m.k, m]),
        "reduce_dtype is None",
    ),
    "a grad_dtype fully_shard would drop (pytorch #172074)": Refusal(
        M, grad_dtype_on_root, "drops Tensor.grad_dtype", not release_traits().keeps_grad_dtype
    ),
}


def snapshot(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[tuple[str, int, int]]]:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    hooks = [
        (n, len(m._forward_pre_hooks), len(m._forward_hooks)) for n, m in model.named_modules()
    ]
    return state, hooks


@pytest.mark.parametrize("name", REFUSALS)
def test_a_refusal_leaves_the_model_untouched(name: str) -> None:
    case = REFUSALS[name]
    if not case.runs:
        pytest.skip("this torch keeps grad_dtype at fully_shard: nothing to refuse")
    model = case.make()
    if name.startswith("a grad_dtype"):  # the refusal's own set-up is part of the input
        model.to(bf16)
        model.b.weight.grad_dtype = fp32  # type: ignore[union-attr]
    (state, hooks), types = snapshot(model), [type(m) for m in model.modules()]
    with pytest.raises(fp.ParamDtypeMapError, match=case.match):
        case.refuse(model)
    assert [type(m) for m in model.modules()] == types  # fully_shard swaps the class
    assert not any(isinstance(m, FSDPModule) for m in model.modules())
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    after, after_hooks = snapshot(model)
    assert after_hooks == hooks
    assert after.keys() == state.keys()
    for key, value in state.items():
        assert after[key].dtype == value.dtype and torch.equal(after[key], value), key


def test_the_same_models_plan_without_the_refused_input() -> None:
    """Control: each model wraps once the refused input is gone (the cases refuse the input,
    not the model)."""
    for make, units in (
        (M, lambda m: [m.k.inner, m.k, m]),
        (Root, lambda m: [m]),
        (Experts, lambda m: [m]),
    ):
        model = make()
        fp.compile_param_dtype_maps(model, rules(), units(model)).apply()
        assert isinstance(model, FSDPModule)
