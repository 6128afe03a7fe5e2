"""verl's topmost rule in the separate-units layout (V8 in ``docs/seeds.md``), on 2 gloo ranks,
collectives counted as they ran.

A subtree kept whole (``mlp``: ``a`` and ``b`` kept fp32) is one unit at its top where ``mlp``'s
forward runs (a traced forward on the plan's ``example_inputs`` says so): 2 all-gathers and 2
reduce-scatters fewer per step than a unit per module, bitwise the same gradients. Where the
parent calls ``mlp.a`` and ``mlp.b`` itself, ``mlp`` never runs: they stay units of their own
(and take the boundary casts), because a unit on ``mlp`` would never gather (the negative
control). Without a trace nothing is lifted."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import fsdp_precision as fp
from fsdp_precision.testing import CollectiveRecorder

from tests.support.harness import collect_cases, distributed_suite

bf16, fp32 = torch.bfloat16, torch.float32


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x.to(fp32))).to(x.dtype)  # casts for itself (boundary="none")


class Runs(nn.Module):
    """``mlp``'s own forward runs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mlp, self.out = nn.Linear(8, 8), MLP(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mlp(self.inp(x)))


class Direct(Runs):
    """The parent calls ``mlp``'s children itself: ``mlp.forward`` never runs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(self.mlp.b(self.mlp.a(h.to(fp32))).to(h.dtype))


def x() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def step(cls: type[Runs], boundary: str, traced: bool) -> dict[str, Any]:
    model = cls()
    rules = fp.PrecisionRules(
        param_dtype=bf16, reduce_dtype=fp32, rules=(fp.Glob("mlp.*", boundary=boundary),)
    )
    plan = fp.compile_param_dtype_maps(
        model,
        rules,
        [model],
        layout="separate_units",
        world_size=2,
        example_inputs=x() if traced else None,
    )
    plan.apply()
    with CollectiveRecorder() as recorder:
        model(x()).float().sum().backward()
    totals = plan.totals()
    assert recorder.count("all_gather") == totals["all_gathers_per_step"]
    assert recorder.count("reduce_scatter") == totals["reduce_scatters_per_step"]
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}  # type: ignore[union-attr]
    assert grads["mlp.a.weight"].dtype == fp32
    return {
        "units": [u.name for u in plan.units],
        "gathers": recorder.count("all_gather"),
        "grads": grads,
    }


def case_a_running_subtree_is_one_unit_at_its_top() -> None:
    for boundary in ("none", "inputs_outputs"):
        top = step(Runs, boundary, traced=True)
        assert top["units"] == ["mlp", "<root>"], (boundary, top["units"])
        if boundary == "none":
            each = step(Runs, boundary, traced=False)  # no trace: one unit per owner
            assert each["units"] == ["mlp.a", "mlp.b", "<root>"]
            assert each["gathers"] == top["gathers"] + 2  # forward: one per unit; and back
            for name, grad in top["grads"].items():
                assert torch.equal(grad, each["grads"][name]), name


def case_children_called_by_the_parent_stay_units_of_their_own() -> None:
    for boundary in ("none", "inputs_outputs"):
        found = step(Direct, boundary, traced=True)
        assert found["units"] == ["mlp.a", "mlp.b", "<root>"], (boundary, found["units"])
    # untraced, the cast sits on mlp (and inputs on its children), where it never fires
    for traced, where in ((True, ["mlp.a", "mlp.b"]), (False, ["mlp", "mlp.a", "mlp.b"])):
        model = Direct()  # the in-unit layout's boundary casts: where the forwards run
        rules = fp.PrecisionRules(param_dtype=bf16, rules=(fp.Glob("mlp.*"),))
        inputs = x() if traced else None
        plan = fp.compile_param_dtype_maps(model, rules, [model], example_inputs=inputs)
        assert sorted(plan.module_casts) == where, (traced, sorted(plan.module_casts))


def case_negative_control_a_unit_on_a_module_that_never_runs_never_gathers() -> None:
    model = Direct()
    fully_shard(model.mlp, mp_policy=fp.ParamDtypeMixedPrecisionPolicy(reduce_dtype=fp32))
    fully_shard(model)
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        model(x())


CASES = collect_cases(globals())
results, test_case = distributed_suite(2, __name__, CASES)
