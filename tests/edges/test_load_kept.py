"""Loading under FSDP keeps every dtype the plan gave (verl's V20-V22 in ``docs/seeds.md``): a
kept weight tied across two modules and a floating persistent buffer of another dtype (as
DeepSeek-V3's fp32 ``e_score_correction_bias`` in a bf16 model), loaded from a full state dict
in another dtype (fp64) on 2 gloo ranks, through each loader: ``load_model_state_dict`` full and
sharded, and ``wrap_model_for_training`` from a meta model. Every alias and the buffer are
asserted, in dtype and value, on every rank. A multi-rank full load also hands the state dict's
``_metadata`` (module versions) to every rank."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_precision as fp
from fsdp_precision.checkpoint import load_model_state_dict, model_state_dict

from tests.edges.test_state_metadata import Versioned
from tests.support.harness import collect_cases, distributed_suite

bf16, fp32, fp64 = torch.bfloat16, torch.float32, torch.float64
RULES = fp.PrecisionRules(
    param_dtype=bf16, reduce_dtype=fp32, rules=(fp.Glob("emb.weight"),), advice="off"
)
#: What each state dict key holds after a load: the kept tied weight (both names) and the buffer
#: fp32, the rest in the bulk storage dtype.
HELD = {
    "emb.weight": fp32,
    "head.weight": fp32,
    "body.weight": bf16,
    "body.bias": bf16,
    "e_score_correction_bias": fp32,
}


class Tied(nn.Module):
    """An embedding tied to the head (both kept), a bf16 body, an fp32 persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("e_score_correction_bias", torch.zeros(11, dtype=fp32))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(ids))).float() + self.e_score_correction_bias


def built(device: str = "cpu") -> Tied:
    """The training model as a checkpoint loader finds it: parameters stored in bf16, the
    buffer in fp32."""
    with torch.device(device):
        model = Tied()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            param.data = param.data.to(bf16)
    return model


def source() -> dict[str, torch.Tensor]:
    """The full state dict in fp64 (every value off the bf16 and fp32 grids), same on all
    ranks; both tied names present, as ``state_dict()`` writes them."""
    g = torch.Generator().manual_seed(7)
    model = Tied().double()
    out = {k: torch.randn(v.shape, generator=g, dtype=fp64) for k, v in model.state_dict().items()}
    out["head.weight"] = out["emb.weight"]
    return out


def wrapped(model: nn.Module) -> nn.Module:
    plan = fp.compile_param_dtype_maps(model, RULES, [model.body, model], world_size=2)
    plan.apply()
    return model


def assert_held(model: Tied, src: dict[str, torch.Tensor]) -> None:
    assert model.head.weight is model.emb.weight  # still one parameter, two names
    state = model.state_dict()
    assert set(state) == set(HELD)
    for key, dtype in HELD.items():
        value = state[key]
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        assert value.dtype == dtype, (key, value.dtype)
        assert torch.equal(value.detach().cpu(), src[key].to(dtype)), key
    # The check can fail: fp64 values rounded to bf16 are not the fp32 ones.
    assert not torch.equal(src["emb.weight"].to(bf16).to(fp32), src["emb.weight"].to(fp32))


def case_a_full_load_holds_every_alias_and_the_buffer_in_its_dtype() -> None:
    src = source()
    model = wrapped(built())
    load_model_state_dict(model, src if dist.get_rank() == 0 else {}, "full")
    assert_held(model, src)


def case_a_sharded_load_holds_every_alias_and_the_buffer_in_its_dtype() -> None:
    src = source()
    first = wrapped(built())
    load_model_state_dict(first, src if dist.get_rank() == 0 else {}, "full")
    second = wrapped(built())
    load_model_state_dict(second, model_state_dict(first, "sharded"), "sharded")
    assert_held(second, src)


def case_the_wrap_fills_a_meta_model_with_every_alias_and_the_buffer_in_its_dtype() -> None:
    src = source()
    config = fp.DistributedConfig(fsdp_mixed_precision=RULES)
    model = fp.wrap_model_for_training(
        built("meta"), config, full_state_dict=src if dist.get_rank() == 0 else {}
    )
    assert isinstance(model, Tied)
    assert_held(model, src)


def case_a_full_load_hands_the_module_versions_to_every_rank() -> None:
    source_model = nn.Sequential(Versioned(), nn.Linear(4, 4))
    with torch.no_grad():
        source_model[0].w.copy_(torch.arange(4.0))
    old: Any = OrderedDict(
        (k, v * 2 if k == "0.w" else v) for k, v in source_model.state_dict().items()
    )
    old._metadata = OrderedDict([("", {"version": 1}), ("0", {"version": 1}), ("1", {})])
    target = nn.Sequential(Versioned(), nn.Linear(4, 4))
    fp.compile_param_dtype_maps(target, fp.PrecisionRules(advice="off"), [target]).apply()
    load_model_state_dict(target, old if dist.get_rank() == 0 else {}, "full")
    w = target[0].w.full_tensor()  # type: ignore[operator]
    assert torch.equal(w.detach(), torch.arange(4.0)), (dist.get_rank(), w)  # migrated: halved


CASES = collect_cases(globals())
results, test_case = distributed_suite(2, __name__, CASES)
