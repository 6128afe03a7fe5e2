"""PEFT LoRA with the real package: fp32 adapters beside a frozen bf16 base inside one unit.

The layout is PEFT's own: ``get_peft_model(bf16 model, LoraConfig, autocast_adapter_dtype=True)``
keeps the adapters in fp32. Through ``wrap_model_for_training`` and through ``model_policy``
(the way frameworks that call ``fully_shard`` themselves would pass it), on 2 gloo ranks.

The export: ``export_safetensors`` of the wrapped LoRA model writes PEFT's layout
(``adapter_model.safetensors``, ``adapter_config.json``), which ``PeftModel.from_pretrained``
loads with the trained fp32 adapters bit for bit, the same keys and values PEFT's own
``save_pretrained`` writes from the unsharded model; ``full_weights`` yields PEFT's names."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import fsdp_precision as fp
from fsdp_precision.checkpoint import export_safetensors
from fsdp_precision.testing import CollectiveRecorder, GatherProbe

from tests.support.harness import collect_cases, distributed_suite
from tests.support.hf_models import tiny_llama

peft = pytest.importorskip("peft", reason="peft is not installed (pip install '.[peft]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

bf16, fp32 = torch.bfloat16, torch.float32
RULES = fp.PrecisionRules(param_dtype=bf16, reduce_dtype=fp32, rules=(fp.Glob("*lora_*"),))


def lora_model() -> nn.Module:
    base = tiny_llama(64, bf16)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(base, lora, autocast_adapter_dtype=True)


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def layers(model: nn.Module) -> list[nn.Module]:
    return list(model.base_model.model.model.layers)


def step(model: nn.Module) -> tuple[dict[str, torch.dtype], CollectiveRecorder]:
    """One forward/backward; what each unit gathered and every collective."""
    with CollectiveRecorder() as recorder, GatherProbe(model) as probe:
        model(**batch()).loss.backward()
    return {k: v.dtype for k, v in probe.seen.items()}, recorder


def check_layout(model: nn.Module, seen: dict[str, torch.dtype]) -> None:
    adapters = [n for n, p in model.named_parameters() if "lora_" in n]
    assert adapters and all(seen[n] == fp32 for n in adapters), {n: seen[n] for n in adapters}
    assert all(d == bf16 for n, d in seen.items() if "lora_" not in n)
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name  # FSDP2 sharded it
        if param.requires_grad:
            assert "lora_" in name and param.grad is not None and param.grad.dtype == fp32
        else:
            assert param.dtype == bf16 and param.grad is None  # the frozen base


def counts(recorder: CollectiveRecorder) -> tuple[int, int]:
    ops = [c.kind for c in recorder.calls]
    return ops.count("all_gather"), ops.count("reduce_scatter")


def case_wrap_model_for_training_keeps_adapters_in_fp32() -> None:
    model = lora_model()
    config = fp.DistributedConfig(
        fsdp_auto_wrap_policy="transformer_block",
        fsdp_mixed_precision=fp.PrecisionRules(rules=(fp.Glob("*lora_*"),)),
    )
    model = fp.wrap_model_for_training(model, config)
    seen, _ = step(model)
    check_layout(model, seen)


def case_model_policy_keeps_adapters_in_fp32_with_no_extra_collectives() -> None:
    model = lora_model()
    policy = fp.model_policy(model, RULES)
    for layer in layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    seen, recorder = step(model)
    check_layout(model, seen)
    # Negative control: the same units with a plain policy gather the adapters in bf16, with the
    # same collectives: the kept adapters cost no extra unit.
    plain = lora_model()
    mp = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    for layer in layers(plain):
        fully_shard(layer, mp_policy=mp)
    fully_shard(plain, mp_policy=mp)
    plain_seen, plain_recorder = step(plain)
    assert all(d == bf16 for d in plain_seen.values()), plain_seen
    # 2 layer units gathered in forward and backward + the root once; reduce-scatters only where
    # something trains (the root holds the frozen embedding, norm and head).
    assert counts(recorder) == counts(plain_recorder) == (5, 2), counts(recorder)


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def case_export_is_the_adapter_peft_loads_and_saves() -> None:
    model = lora_model()
    policy = fp.model_policy(model, RULES)
    for layer in layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):  # the adapters move away from their initial values
        model(**batch()).loss.backward()
        optim.step()
        optim.zero_grad()
    trained = {n: p.full_tensor() for n, p in model.named_parameters() if "lora_" in n}
    assert trained and all(t.dtype == fp32 for t in trained.values())
    # PEFT's names: the adapter name ("default") dropped, as PEFT saves and loads them.
    stream = fp.full_weights(model, dtype="stored")
    names = [m.name for m in stream.metadata]
    assert names == [n.replace(".default", "") for n in trained], names
    assert all(m.dtype == fp32 and m.kept is not None for m in stream.metadata)
    streamed = dict(stream)  # collective: every rank iterates
    where = [tempfile.mkdtemp() if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(where, src=0)
    root = Path(where[0])
    try:
        weights = export_safetensors(model, root / "export", dtype=bf16)  # collective
        if dist.get_rank() != 0:
            return
        out = weights.parent
        assert weights.name == "adapter_model.safetensors"
        assert sorted(p.name for p in out.iterdir()) == [
            "adapter_config.json", "adapter_model.safetensors", "fsdp_precision_export.json"
        ]  # fmt: skip
        ours = read_safetensors(weights)  # the adapters are kept: fp32 even with dtype=bf16
        assert ours.keys() == set(names) and all(t.dtype == fp32 for t in ours.values())
        assert all(torch.equal(ours[n], streamed[n]) for n in names)
        # PeftModel.from_pretrained loads them, bit for bit.
        loaded = peft.PeftModel.from_pretrained(tiny_llama(64, bf16), out)
        params = dict(loaded.named_parameters())
        for name, tensor in trained.items():
            assert params[name].dtype == fp32 and torch.equal(params[name], tensor), name
        # PEFT's own save_pretrained, from an unsharded model holding the trained adapters,
        # writes the same keys and values, and the same adapter config.
        unsharded = lora_model()
        with torch.no_grad():
            for name, p in unsharded.named_parameters():
                if name in trained:
                    p.copy_(trained[name])
        unsharded.save_pretrained(str(root / "peft"))
        theirs = read_safetensors(root / "peft" / "adapter_model.safetensors")
        assert theirs.keys() == ours.keys(), sorted(theirs.keys() ^ ours.keys())
        for name, tensor in theirs.items():
            assert tensor.dtype == ours[name].dtype and torch.equal(tensor, ours[name]), name
        config = json.loads((out / "adapter_config.json").read_text())
        expected = json.loads((root / "peft" / "adapter_config.json").read_text())
        # PEFT writes a set-valued field in the set's iteration order, which differs between
        # copies; the export writes it sorted, the same bytes every time.
        as_sets = [k for k, v in vars(model.peft_config["default"]).items() if isinstance(v, set)]
        assert "target_modules" in as_sets, as_sets
        for key in as_sets:
            assert config[key] == sorted(config[key]), (key, config[key])
            assert sorted(expected[key]) == config[key], (key, expected[key], config[key])
            expected[key] = config[key]
        differ = {k: (config.get(k), expected.get(k)) for k in {*config, *expected}}
        assert config == expected, {k: v for k, v in differ.items() if v[0] != v[1]}
        # Negative control: the untrained adapters differ, so the equalities above need the
        # trained values.
        assert not any(torch.equal(p, trained[n]) for n, p in lora_model().named_parameters()
                       if n in trained)  # fmt: skip
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)


CASES = collect_cases(globals())

results, test_peft = distributed_suite(2, __name__, CASES)
