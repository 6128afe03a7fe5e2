"""TRL's SFTTrainer with the real package, on 2 CPU ranks (gloo).

SFTTrainer is an HF ``Trainer``: it builds accelerate's FSDP2 plugin from
``SFTConfig.fsdp_plugin_args``, so ``trainer_fsdp_policy`` hands it a ``model_policy`` the same
way. That policy keeps DeepSeek-V3's ``_keep_in_fp32_modules_strict`` router gates in fp32; the
same SFTTrainer with the Trainer's own ``bf16=True`` policy gathers them in bf16 (the negative
control), with the same collectives. On CPU accelerate would fall back to DDP:
``accelerate_fsdp2_on_cpu`` turns FSDP2 back on, and the cases assert DTensors. Parity: 2 SFT
steps with ``model_policy`` are bitwise equal to the separate-units reference (each gate its own
fp32 unit made before the trainer, plain policy); the plain policy alone is not. PEFT:
``SFTTrainer(peft_config=...)`` adds the adapters after a policy built on the base, which is
refused by name; the recipe (``get_peft_model`` first, the policy on the PeftModel) keeps them
in fp32.

No downloads: the model is built from its config, the tokenizer from an in-memory WordLevel
vocabulary, and the dataset is pre-tokenized ``input_ids``.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import fsdp_precision as fp
from fsdp_precision.integrations import (
    cpu_fsdp2_trainer,
    trainer_fsdp_policy,
)
from fsdp_precision.testing import CollectiveRecorder, GatherProbe

from tests.support.harness import collect_cases, distributed_suite, fresh_accelerate_state
from tests.support.hf_models import deepseek_v3, tiny_llama

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


def separate_gate_units(model: nn.Module) -> None:
    """The separate-units reference: each router gate its own fp32 unit (param_dtype=None, the
    gates are stored in fp32), made before the trainer's ``fully_shard`` calls."""
    from torch.distributed.fsdp import fully_shard

    for name in gates(model):
        gate = model.get_submodule(name.rsplit(".", 1)[0])
        fully_shard(gate, mp_policy=MixedPrecisionPolicy(reduce_dtype=fp32))


def sft_config(out: str, layer: str) -> Any:
    """2 steps of FSDP2 on CPU, each ``layer`` a unit, every step logged."""
    from trl import SFTConfig

    return SFTConfig(
        output_dir=out, use_cpu=True, bf16=True, fsdp=True, max_steps=2,
        per_device_train_batch_size=2, report_to=[], save_strategy="no", logging_steps=1,
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": [layer]},
    )  # fmt: skip


def sft_train(policy_for: str) -> tuple[Any, Any]:
    """2 SFT steps of a tiny DeepSeek-V3 under FSDP2; returns (trainer, the policy or None).

    ``policy_for``: 'model' (``model_policy`` through ``trainer_fsdp_policy``), 'trainer' (the
    Trainer's own ``bf16=True`` policy), 'plain' (``MixedPrecisionPolicy(bf16, fp32)`` through
    ``trainer_fsdp_policy``) or 'separate' (each gate its own fp32 unit, made before the
    trainer, then 'plain': the separate-units reference)."""
    from trl import SFTTrainer

    fresh_accelerate_state()

    CpuFsdp2SFTTrainer = cpu_fsdp2_trainer(SFTTrainer)  # accelerate drops FSDP on CPU

    torch.manual_seed(0)
    model = deepseek_v3()
    policy = {
        "model": lambda: fp.model_policy(model, RULES),
        "trainer": lambda: None,
    }.get(policy_for, lambda: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))()
    if policy_for == "separate":
        separate_gate_units(model)  # before the trainer: accelerate wraps around them
    with tempfile.TemporaryDirectory() as out:
        args = sft_config(out, "DeepseekV3DecoderLayer")
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
    trainer, policy = sft_train("model")
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
    plain, _ = sft_train("trainer")
    plain_policy = plain.accelerator.state.fsdp_plugin.mixed_precision_policy
    assert (plain_policy.param_dtype, plain_policy.reduce_dtype) == (bf16, bf16), plain_policy
    plain_seen, plain_counts, plain_reduced = probe_forward(plain.model_wrapped)
    assert all(plain_seen[n] == bf16 for n in kept), {n: plain_seen[n] for n in kept}
    assert plain_reduced == {bf16}, plain_reduced  # bf16=True: bf16 gradient reduction
    assert counts == plain_counts, (counts, plain_counts)
    assert counts[0] > 0 and counts[1] > 0


def trained_state(trainer: Any) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    """The log records (per step: loss, grad norm, token accuracy, ...; then the training loss)
    without the timings, and every parameter gathered, after training."""
    history = [
        {k: v for k, v in r.items() if k != "train_runtime" and not k.endswith("_per_second")}
        for r in trainer.state.log_history
    ]
    wrapped = trainer.model_wrapped
    return history, {n: p.detach().full_tensor() for n, p in wrapped.named_parameters()}


def case_sft_trainer_model_policy_trains_bitwise_like_separate_fp32_units() -> None:
    """Parity: 2 SFT steps, the gates inside their layers' units (``model_policy``) or as
    separate fp32 units made before the trainer (accelerate wraps around them, plain policy),
    log the same records (loss, gradient norm: the one clipping divides by, ``max_grad_norm=1.0``
    by default) and end with the same parameters, bitwise."""
    runs = {v: trained_state(sft_train(v)[0]) for v in ("model", "separate")}
    (history, params), (ref_history, ref_params) = runs["model"], runs["separate"]
    assert sum("loss" in r for r in history) == 2, history  # logging_steps=1
    assert "train_loss" in history[-1] and history == ref_history, (history, ref_history)
    assert params.keys() == ref_params.keys()
    for name, param in params.items():
        assert param.dtype == ref_params[name].dtype and torch.equal(param, ref_params[name]), name
    # Negative control: the plain policy (gates gathered in bf16 in their layers' units) trains
    # differently, so the equality above would fail if model_policy gathered the gates in bf16.
    plain_history, plain_params = trained_state(sft_train("plain")[0])
    assert plain_history != ref_history, plain_history
    kept = [n for n in params if n.endswith("mlp.gate.weight")]
    assert kept and not any(torch.equal(plain_params[n], ref_params[n]) for n in kept), kept


# ---------------------------------------------------------------------- PEFT inside SFTTrainer

LORA_RULES = fp.PrecisionRules(param_dtype=bf16, reduce_dtype=fp32, rules=(fp.Glob("*lora_*"),))


def sft_lora(model: nn.Module, policy: Any, peft_config: Any = None) -> Any:
    """2 SFT steps of ``model`` (PEFT inside the trainer when ``peft_config``) under FSDP2."""
    from trl import SFTTrainer

    fresh_accelerate_state()
    with tempfile.TemporaryDirectory() as out:
        args = sft_config(out, "LlamaDecoderLayer")
        trainer_fsdp_policy(args, policy)
        trainer = cpu_fsdp2_trainer(SFTTrainer)(
            model=model, args=args, train_dataset=dataset(), processing_class=tokenizer(),
            peft_config=peft_config,
        )  # fmt: skip
        trainer.train()
    return trainer


def case_peft_config_inside_sft_trainer_refuses_a_policy_built_before_peft() -> None:
    """SFTTrainer(peft_config=...) adds the adapters after the user built the policy: the
    policy has no entry for them, and the first unit that manages one refuses (they would
    silently compute in param_dtype) rather than train."""
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install '.[peft]')")
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    with pytest.raises(fp.ParamDtypeMapError, match=r"matches no parameter of LlamaForCausalLM"):
        fp.model_policy(tiny_llama(VOCAB, bf16), LORA_RULES)  # no adapter exists yet
    base = tiny_llama(VOCAB, fp32)  # fp32 storage, so that the norms can be kept
    norms = fp.PrecisionRules(param_dtype=bf16, reduce_dtype=fp32, rules=(fp.Glob("*norm.weight"),))
    with pytest.raises(
        fp.ParamDtypeMapError,
        match=r"fully_shard manages parameters of modules created after this model_policy was "
        r"built for LlamaForCausalLM: 'self_attn.q_proj.lora_A.default.weight' \(Linear\)",
    ):
        sft_lora(base, fp.model_policy(base, norms), peft_config=lora)


def case_peft_model_handed_to_sft_trainer_keeps_fp32_adapters() -> None:
    """The recipe: get_peft_model first, the policy on the PeftModel, the PeftModel to the
    trainer (no peft_config). The adapters are gathered in fp32 beside the bf16 base, with the
    collectives of the plain policy (the negative control gathers them in bf16)."""
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install '.[peft]')")

    def lora_model() -> nn.Module:
        lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        return peft.get_peft_model(tiny_llama(VOCAB, bf16), lora, autocast_adapter_dtype=True)

    model = lora_model()
    trainer = sft_lora(model, fp.model_policy(model, LORA_RULES))
    wrapped = trainer.model_wrapped
    assert all(isinstance(p, DTensor) for p in wrapped.parameters())  # FSDP2, not DDP
    seen, counts, reduced = probe_forward(wrapped)
    adapters = [n for n, _ in wrapped.named_parameters() if "lora_" in n]
    assert adapters and all(seen[n] == fp32 for n in adapters), {n: seen[n] for n in adapters}
    assert all(d == bf16 for n, d in seen.items() if "lora_" not in n), seen
    assert reduced == {fp32}, reduced
    plain = sft_lora(lora_model(), MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))
    plain_seen, plain_counts, _ = probe_forward(plain.model_wrapped)
    assert all(plain_seen[n] == bf16 for n in adapters)
    assert counts == plain_counts, (counts, plain_counts)


CASES = collect_cases(globals())

results, test_trl = distributed_suite(2, __name__, CASES)
