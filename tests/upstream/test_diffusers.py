"""verl-omni #401: a Diffusers model that declares ``_keep_in_fp32_modules`` was run entirely in
fp32 (the engine gave the whole transformer ``param_dtype=None`` because it declares keeps).
Here only the declared modules compute in fp32: a tiny Wan under one unit per block and the
root, the rest gathered in bf16; the negative control is verl-omni's rule, everything fp32.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fsdp_precision as fp
from fsdp_precision.testing import GatherProbe

from tests.support.hf_models import wan, wan_model_inputs

pytest.importorskip("diffusers", reason="diffusers is not installed (pip install '.[hf]')")
pytestmark = pytest.mark.usefixtures("world1")
bf16, fp32 = torch.bfloat16, torch.float32
DECLARED = ("scale_shift_table", "time_embedder", "norm2")  # among Wan's _keep_in_fp32_modules


def gathered(policy_for: str) -> dict[str, torch.dtype]:
    torch.manual_seed(0)
    model = wan()
    units = [*model.blocks, model]
    if policy_for == "library":
        rules = fp.PrecisionRules(param_dtype=bf16, reduce_dtype=fp32)
        fp.compile_param_dtype_maps(model, rules, units).apply()
    else:  # verl-omni #401: keeps declared, so param_dtype=None for the whole transformer
        for unit in units:
            fully_shard(unit, mp_policy=MixedPrecisionPolicy(param_dtype=None, reduce_dtype=fp32))
    with GatherProbe(model) as probe, torch.no_grad():
        model(**wan_model_inputs(torch.Generator().manual_seed(0)))
    return {n: g.dtype for n, g in probe.seen.items()}


def test_401_only_the_declared_modules_compute_in_fp32() -> None:
    seen = gathered("library")
    kept = {n for n in seen if any(d in n for d in DECLARED)}
    assert kept and all(seen[n] == fp32 for n in kept), {n: seen[n] for n in kept}
    bulk = {n: d for n, d in seen.items() if n not in kept}
    assert bulk and set(bulk.values()) <= {bf16, fp32}
    assert sum(d == bf16 for d in bulk.values()) > len(bulk) // 2, bulk  # the blocks' matmuls
    assert all(
        bulk[n] == bf16 for n in bulk if n.endswith(("to_q.weight", "ffn.net.0.proj.weight"))
    )


def test_401_param_dtype_none_runs_everything_in_fp32() -> None:
    """The negative control: verl-omni's rule gathers every parameter in fp32."""
    assert set(gathered("verl_omni").values()) == {fp32}
