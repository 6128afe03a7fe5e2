"""The separate-units layout wraps a kept module that owns parameters after the planned units
inside it (verl's seed contract: a refused layout wraps nothing), and a plan whose order
``fully_shard`` cannot take is refused before its first call, the model untouched. One gloo
rank."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import fsdp_precision as fp

pytestmark = pytest.mark.usefixtures("world1")
bf16, fp32 = torch.bfloat16, torch.float32


class K(nn.Module):
    """Owns a kept parameter beside a child that is a planned unit; casts for itself."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(8) + 0.5)
        self.inner = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner((x * self.scale).to(self.scale.dtype)).to(x.dtype)


class M(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.k, self.b = nn.Linear(8, 8), K(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.k(self.a(x)))


RULES = fp.PrecisionRules(
    param_dtype=bf16, reduce_dtype=fp32, rules=(fp.Glob("k.*", boundary="none"),)
)


def trained(layout: str) -> tuple[nn.Module, list[str]]:
    model = M()
    plan = fp.compile_param_dtype_maps(model, RULES, [model.k.inner, model], layout=layout)
    plan.apply()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    model(x).float().sum().backward()
    return model, [u.name for u in plan.units]


def test_a_kept_module_is_wrapped_after_the_planned_unit_inside_it() -> None:
    separate, order = trained("separate_units")
    assert order == ["k.inner", "k", "<root>"], order  # k's own unit after the one inside it
    assert isinstance(separate.k, FSDPModule) and isinstance(separate.k.inner, FSDPModule)
    in_unit, _ = trained("in_unit")
    for (name, a), (_, b) in zip(
        separate.named_parameters(), in_unit.named_parameters(), strict=True
    ):
        assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor()), name  # type: ignore[union-attr]
    assert separate.k.scale.grad.dtype == fp32  # type: ignore[union-attr]


class Bare(nn.Module):
    """``K`` without its own cast: its fp32 output meets the next bf16 layer."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(8) + 0.5)
        self.inner = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x * self.scale)


class MBare(M):
    def __init__(self) -> None:
        super().__init__()
        self.k = Bare()


def _notes(exc: BaseException) -> list[str]:
    lines = getattr(exc, "__notes__", None) or str(exc).splitlines()  # 3.10: in the message
    return [line for line in lines if line.startswith("fsdp-precision: ")]


def test_the_same_rules_name_the_kept_module_in_every_layout() -> None:
    """``boundary="none"`` on a module that does not cast for itself: the first forward fails
    in both layouts, and both add the library's note naming ``k`` and the fix (the separate
    units raised torch's bare "mat1 and mat2 must have the same dtype"; issue 48)."""
    notes = {}
    for layout in ("in_unit", "separate_units"):
        model = MBare()
        plan = fp.compile_param_dtype_maps(model, RULES, [model.k.inner, model], layout=layout)
        assert plan.layout == layout
        plan.apply()
        with pytest.raises(RuntimeError, match="same dtype") as info:
            model(torch.randn(4, 8))
        notes[layout] = _notes(info.value)
    assert notes["separate_units"] == notes["in_unit"], notes
    (note,) = notes["in_unit"]
    assert "kept modules returned activations in their kept dtype: 'k' (Bare)" in note
    assert "boundary='inputs_outputs'" in note


def test_a_plan_in_an_order_fully_shard_cannot_take_is_refused_untouched() -> None:
    model = M()
    before = copy.deepcopy(model.state_dict())
    plan = fp.compile_param_dtype_maps(
        model, fp.PrecisionRules(param_dtype=bf16), [model.k, model.k.inner, model]
    )
    with pytest.raises(fp.ParamDtypeMapError, match=r"unit k.inner is planned after unit k"):
        plan.apply()
    assert not any(isinstance(m, FSDPModule) for m in model.modules())
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
