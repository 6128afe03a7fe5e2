"""A traced forward (the plan's parameter uses, the advisor) of a transformers MoE reaches its
end on the meta device: fused experts dispatch to ``batched_mm`` while it runs."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

from fsdp_precision._advise import usage
from fsdp_precision._advise.usage import param_usage

pytest.importorskip("transformers", reason="transformers is not installed")


def _qwen3_moe_on_meta() -> torch.nn.Module:
    from tests.support import load_script

    keep = load_script("scripts/screen_hf_keep.py")
    with torch.device("meta"):
        model = keep.build("qwen3_moe")
    # As its own config has it (the screen's tiny one turns the cache off, and without a cache
    # transformers checks position ids for packed sequences, which a meta tensor cannot answer).
    model.config.use_cache = True
    return model


def test_the_trace_reaches_the_end_and_restores_the_config() -> None:
    model = _qwen3_moe_on_meta()
    before = model.config._experts_implementation
    uses = param_usage(model)
    assert uses.traced == "traced a forward on Qwen3MoeForCausalLM.dummy_inputs"
    assert any("experts" in fqn for fqn in uses.uses)
    assert model.config._experts_implementation == before


def _grouped_mm_takes_fp32_on_meta() -> bool:
    a = torch.empty(8, 4, device="meta")
    b = torch.empty(2, 4, 4, device="meta")
    offs = torch.tensor([4, 8], dtype=torch.int32, device="meta")
    try:
        torch._grouped_mm(a, b, offs=offs)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def test_negative_control_without_the_switch_it_stops_at_the_experts(monkeypatch) -> None:
    if _grouped_mm_takes_fp32_on_meta():
        pytest.skip(f"torch {torch.__version__}'s grouped_mm takes fp32 on meta: no trace stops")
    monkeypatch.setattr(usage, "traceable_experts", lambda *_: contextlib.nullcontext())
    uses = param_usage(_qwen3_moe_on_meta())
    # the meta kernel refuses fp32 ("Expected inputs of BF16 type", 2.14: "BFloat16 or ...")
    assert "stopped early" in uses.traced and re.search(r"BF16|BFloat16", uses.traced)
