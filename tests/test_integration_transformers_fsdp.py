"""transformers' native FSDP2 (``from_pretrained(..., distributed_config=...)``) with the opt-in.

transformers wraps the model itself with one hard-coded ``MixedPrecisionPolicy(bf16, fp32)``:
DeepSeek-V3's ``_keep_in_fp32_modules_strict`` router gates get their own unit and are still
gathered in bf16 (the negative control). Inside ``transformers_native_fsdp(rules)`` every call
gets ``model_policy(model, rules)``: the gates are gathered in fp32, the collectives unchanged.
2 gloo ranks, a real checkpoint written by ``save_pretrained`` of a tiny model.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_precision as fp
from fsdp_precision.integrations import transformers_native_fsdp
from fsdp_precision.testing import CollectiveRecorder, GatherProbe

from _harness import collect_cases, distributed_suite, torchrun_environment
from _hf_models import deepseek_v3

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
if not hasattr(transformers, "DistributedConfig"):
    pytest.skip("this transformers has no native FSDP2 path", allow_module_level=True)

bf16, fp32 = torch.bfloat16, torch.float32
RULES = fp.PrecisionRules(param_dtype=bf16, reduce_dtype=fp32)


def load(path: str) -> nn.Module:
    torchrun_environment()
    config = transformers.DistributedConfig(
        fsdp_size=dist.get_world_size(), fsdp_mixed_precision=True
    )
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=bf16, distributed_config=config
    )


def step(model: nn.Module) -> tuple[dict[str, torch.dtype], tuple[int, int]]:
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    with CollectiveRecorder() as recorder, GatherProbe(model) as probe:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    assert torch.isfinite(loss)
    kinds = [c.kind for c in recorder.calls]
    seen = {k: v.dtype for k, v in probe.seen.items()}
    return seen, (kinds.count("all_gather"), kinds.count("reduce_scatter"))


def gates(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters() if n.endswith("mlp.gate.weight")]


def case_native_fsdp_honours_the_keep_declarations() -> None:
    # One checkpoint, written by rank 0 into a directory every rank reads.
    where = [tempfile.mkdtemp() if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(where, src=0)
    path = os.path.join(where[0], "dsv3")
    try:
        if dist.get_rank() == 0:
            torch.manual_seed(0)
            deepseek_v3().save_pretrained(path)
        dist.barrier()
        with transformers_native_fsdp(RULES):
            model = load(path)
        plain = load(path)  # outside the context: transformers' own policy
        dist.barrier()
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(where[0], ignore_errors=True)
    for m in (model, plain):
        not_sharded = [n for n, p in m.named_parameters() if not isinstance(p, DTensor)]
        assert not not_sharded, not_sharded
    kept = gates(model)
    assert kept and all(p.dtype == fp32 for n, p in model.named_parameters() if n in kept)
    seen, counts = step(model)
    assert all(seen[n] == fp32 for n in kept), {n: seen[n] for n in kept}
    assert all(d == bf16 for n, d in seen.items() if n not in kept)
    plain_seen, plain_counts = step(plain)
    assert all(plain_seen[n] == bf16 for n in kept)  # the negative control: precision lost
    assert counts == plain_counts, (counts, plain_counts)


def test_unchecked_transformers_release_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    from fsdp_precision import PatchIntegrityError
    from fsdp_precision._hf_native import CHECKED

    live = importlib.import_module("transformers")  # the module the opt-in reads (sys.modules)
    monkeypatch.setattr(live, "__version__", "9.9.9")
    with pytest.raises(PatchIntegrityError, match=r"was not checked against transformers 9.9.9"):
        with transformers_native_fsdp(RULES):
            pass
    monkeypatch.setattr(live, "__version__", "5.24.0")
    changed = {k: "0" * 64 for k in CHECKED.get("5.24.0", {"x:y": ""})}
    monkeypatch.setitem(CHECKED, "5.24.0", changed)
    with pytest.raises(PatchIntegrityError, match=r"differs from the source the native-FSDP2"):
        with transformers_native_fsdp(RULES):
            pass
    import transformers.distributed.mixin as mixin
    from transformers.distributed.fsdp import apply_fully_sharded_data_parallelism

    assert mixin.apply_fully_sharded_data_parallelism is apply_fully_sharded_data_parallelism


CASES = collect_cases(globals())

results, test_native = distributed_suite(2, __name__, CASES)
