"""TRL's SFTTrainer with the real package, on 2 CPU ranks (gloo).

SFTTrainer is an HF ``Trainer``: it builds accelerate's FSDP2 plugin from
``SFTConfig.fsdp_plugin_args``, so ``trainer_fsdp_policy`` hands it a ``model_policy`` the same
way. That policy keeps DeepSeek-V3's ``_keep_in_fp32_modules_strict`` router gates in fp32; the
same SFTTrainer with the Trainer's own ``bf16=True`` policy gathers them in bf16 (the negative
control), with the same collectives. On CPU accelerate would fall back to DDP:
``accelerate_fsdp2_on_cpu`` turns FSDP2 back on, and the cases assert DTensors.

No downloads: the model is built from its config, the tokenizer from an in-memory WordLevel
vocabulary, and the dataset is pre-tokenized ``input_ids``.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_precision as fp
from fsdp_precision.integrations import (
    cpu_fsdp2_trainer,
    trainer_fsdp_policy,
)
from fsdp_precision.testing import CollectiveRecorder, GatherProbe

from _harness import collect_cases, distributed_suite, fresh_accelerate_state
from _hf_models import deepseek_v3

trl = pytest.importorskip("trl", reason="trl is not installed (pip install '.[trl]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

bf16, fp32 = torch.bfloat16, torch.float32
RULES = fp.PrecisionRules(param_dtype=bf16, reduce_dtype=fp32)  # + the model's declarations
VOCAB = 96  # deepseek_v3()'s vocab_size


def tokenizer() -> Any:
    """A tokenizer over the model's 96 ids, built in memory (SFTTrainer needs one for padding)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")),
        pad_token="<pad>",
        eos_token="<eos>",
    )


def dataset() -> Any:
    """Four pre-tokenized rows (SFTTrainer takes ``input_ids`` as they are)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    return Dataset.from_dict({"input_ids": torch.randint(2, VOCAB, (4, 8), generator=g).tolist()})


def gates(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters() if n.endswith("mlp.gate.weight")]


def sft_train(with_policy: bool) -> tuple[Any, Any]:
    """2 SFT steps of a tiny DeepSeek-V3 under FSDP2; returns (trainer, the policy or None)."""
    from trl import SFTConfig, SFTTrainer

    fresh_accelerate_state()

    CpuFsdp2SFTTrainer = cpu_fsdp2_trainer(SFTTrainer)  # accelerate drops FSDP on CPU

    torch.manual_seed(0)
    model = deepseek_v3()
    policy = fp.model_policy(model, RULES) if with_policy else None
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(
            output_dir=out, use_cpu=True, bf16=True, fsdp=True, max_steps=2,
            per_device_train_batch_size=2, report_to=[], save_strategy="no",
            fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["DeepseekV3DecoderLayer"]},
        )  # fmt: skip
        if policy is not None:
            trainer_fsdp_policy(args, policy)
        trainer = CpuFsdp2SFTTrainer(
            model=model, args=args, train_dataset=dataset(), processing_class=tokenizer()
        )
        result = trainer.train()
    assert result.global_step == 2, result
    assert torch.isfinite(torch.tensor(result.training_loss)), result
    return trainer, policy


def probe_forward(
    wrapped: nn.Module,
) -> tuple[dict[str, torch.dtype], tuple[int, int], set[torch.dtype]]:
    """Gathered dtypes, (all-gathers, reduce-scatters) and reduce-scatter dtypes of one step."""
    ids = torch.randint(2, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    with CollectiveRecorder() as recorder, GatherProbe(wrapped) as probe:
        wrapped(input_ids=ids, labels=ids).loss.backward()
    kinds = [c.kind for c in recorder.calls]
    counts = (kinds.count("all_gather"), kinds.count("reduce_scatter"))
    reduced = {c.dtype for c in recorder.calls if c.kind == "reduce_scatter"}
    return {n: p.dtype for n, p in probe.seen.items()}, counts, reduced


def case_sft_trainer_keeps_the_router_gates_in_fp32() -> None:
    trainer, policy = sft_train(with_policy=True)
    plugin = trainer.accelerator.state.fsdp_plugin
    assert plugin.mixed_precision_policy is policy  # the Trainer and accelerate kept the object
    wrapped = trainer.model_wrapped
    names = [n for n, _ in wrapped.named_parameters()]
    not_sharded = [n for n, p in wrapped.named_parameters() if not isinstance(p, DTensor)]
    assert not not_sharded, not_sharded  # FSDP2 wrapped it, not DDP
    seen, counts, reduced = probe_forward(wrapped)
    assert len(seen) == len(names), sorted(set(names) - set(seen))
    kept = gates(wrapped)
    assert kept and all(seen[n] == fp32 for n in kept), {n: seen[n] for n in kept}
    assert all(d == bf16 for n, d in seen.items() if n not in kept), seen
    assert reduced == {fp32}, reduced  # the rules' reduce_dtype
    # Negative control: the same SFTTrainer with the Trainer's own bf16=True policy
    # (MixedPrecisionPolicy(bf16, bf16, bf16)) gathers the gates in bf16, with exactly the same
    # collectives (the kept gates cost no unit).
    plain, _ = sft_train(with_policy=False)
    plain_policy = plain.accelerator.state.fsdp_plugin.mixed_precision_policy
    assert (plain_policy.param_dtype, plain_policy.reduce_dtype) == (bf16, bf16), plain_policy
    plain_seen, plain_counts, plain_reduced = probe_forward(plain.model_wrapped)
    assert all(plain_seen[n] == bf16 for n in kept), {n: plain_seen[n] for n in kept}
    assert plain_reduced == {bf16}, plain_reduced  # bf16=True: bf16 gradient reduction
    assert counts == plain_counts, (counts, plain_counts)
    assert counts[0] > 0 and counts[1] > 0


CASES = collect_cases(globals())

results, test_trl = distributed_suite(2, __name__, CASES)
