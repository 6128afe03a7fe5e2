"""Fine-tune Qwen3-MoE with TRL's SFTTrainer on FSDP2, the way a real run goes: bf16 compute, the
router gates in fp32, gradients reduced in fp32; a checkpoint every 3 steps (the Trainer's default
save strategy, "steps"), a resume in a fresh launch, and the trained model exported twice.

    torchrun --standalone --nproc_per_node 2 examples/trl_sft_qwen3_moe.py   # CPU, a temp dir
    torchrun --standalone --nproc_per_node 2 examples/trl_sft_qwen3_moe.py --lora   # + LoRA
    # preempted after step 4 (checkpoint-3 written), then a fresh launch resumes and ends at 6:
    torchrun --standalone --nproc_per_node 2 examples/trl_sft_qwen3_moe.py --output-dir run \
        --stop-after 4
    torchrun --standalone --nproc_per_node 2 examples/trl_sft_qwen3_moe.py --output-dir run

A tiny Qwen3-MoE is saved and loaded the way a real checkpoint is,
``from_pretrained(dir, dtype=torch.bfloat16)``: its gates arrive in bf16, and the rule keeping
them in fp32 upcasts them exactly. ``Qwen3MoeTopKRouter`` calls ``F.linear`` on its input as it
comes; the rule's boundary cast (``boundary="auto"``) casts it to fp32.

The edges of the run:

- Save: the Trainer writes ``checkpoint-3`` and ``checkpoint-6`` into ``--output-dir`` (its
  ``training_args.bin`` holds the policy as a plain record). The save is not atomic
  (``trainer_state.json`` comes last): a launch resumes from ``last_complete_checkpoint``, never
  from a half-written one, which ``resume_from_checkpoint=True`` would pick.
- Export: ``trainer.save_model()`` (the Trainer's: every tensor as accelerate stores it, the fp32
  masters) and ``export_safetensors(..., dtype=torch.bfloat16)`` (the library's: the bulk in
  bf16, the gates in fp32, sharded at ``max_shard_size``, a record of what was kept). Rank 0
  reloads the export with ``from_pretrained`` (which rounds the gates to bf16: Qwen3-MoE declares
  no keep for them) and ``restore_kept`` puts the trained fp32 gates back, bit for bit. With
  ``--lora`` the export is the PEFT adapter (``PeftModel.from_pretrained(base, dir)`` loads it).

It prints a digest of every trained parameter: an interrupted and resumed run prints the same
digest as an uninterrupted one (the test compares them).

On GPUs: load your checkpoint instead of the tiny one, use ``SFTTrainer`` itself (not
``cpu_fsdp2_trainer``, which turns FSDP2 back on where accelerate would fall back to DDP on a
CPU-only machine), and drop ``use_cpu``. CI runs this file.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from datasets import Dataset
from safetensors import safe_open
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from torch.distributed.tensor import DTensor
from transformers import (
    AutoModelForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
    TrainerCallback,
    set_seed,
)
from trl import SFTConfig, SFTTrainer

from fsdp_precision import Glob, PrecisionRules, model_policy
from fsdp_precision.checkpoint import export_safetensors, read_export_record, restore_kept
from fsdp_precision.integrations import (
    cpu_fsdp2_trainer,
    last_complete_checkpoint,
    trainer_fsdp_policy,
)
from fsdp_precision.testing import GatherProbe

VOCAB = 128
STEPS, SAVE_STEPS = 6, 3


def tiny_checkpoint(directory: str) -> str:
    """A randomly initialised tiny Qwen3-MoE, saved by rank 0 as a real checkpoint (no
    download); every rank returns when it is written."""
    if dist.get_rank() != 0:
        dist.barrier()
        return directory
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    dist.barrier()
    return directory


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")),
        pad_token="<pad>",
        eos_token="<eos>",
    )


class Preempted(TrainerCallback):
    """Stops training after step ``n`` without saving: what a preemption leaves behind."""

    def __init__(self, n: int) -> None:
        self.n = n

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step >= self.n:
            control.should_training_stop = True
        return control


def shared_dir(path: str | None) -> str:
    """``path``, or a new temporary directory rank 0 made; the same string on every rank."""
    where = [path or (tempfile.mkdtemp(prefix="trl-sft-") if dist.get_rank() == 0 else "")]
    dist.broadcast_object_list(where, src=0)
    return where[0]


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole (collective: every rank gathers every parameter in order)."""
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def digest(params: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every parameter's name, dtype and bytes."""
    h = hashlib.sha256()
    for name, t in params.items():
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def dtypes_of(directory: Path) -> Counter[str]:
    """How many tensors of each dtype the safetensors files in ``directory`` hold."""
    counts: Counter[str] = Counter()
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is no mapping
                counts[str(f.get_slice(name).get_dtype())] += 1
    return counts


def check_model_export(export: Path, trained: dict[str, torch.Tensor], gates: list[str]) -> str:
    """Rank 0: the transformers export reloads, and ``restore_kept`` brings the trained fp32
    gates back exactly; the bulk is the trained fp32 masters rounded to bf16."""
    loaded = AutoModelForCausalLM.from_pretrained(export, dtype=torch.bfloat16)
    params = dict(loaded.named_parameters())
    rounded = [n for n in gates if params[n].dtype == torch.bfloat16]
    assert rounded == gates, rounded  # from_pretrained rounded them: no declaration keeps them
    assert not all(torch.equal(params[n].float(), trained[n]) for n in gates)
    restored = restore_kept(loaded, export)
    params = dict(loaded.named_parameters())
    assert sorted(restored) == sorted(gates), restored
    for name, param in params.items():
        want = trained[name] if name in gates else trained[name].to(torch.bfloat16)
        assert param.dtype == want.dtype and torch.equal(param, want), name
    record = read_export_record(export)
    shards = [f for f in record.files if f.endswith(".safetensors")]
    return (
        f"library export: {len(shards)} shards, {dict(dtypes_of(export))}; reloaded with "
        f"from_pretrained(dtype=bf16) the {len(gates)} gates were rounded to bf16, restore_kept "
        f"put back their trained fp32 values (bitwise)"
    )


def check_adapter_export(
    export: Path, base: str, trained: dict[str, torch.Tensor], adapters: list[str]
) -> str:
    """Rank 0: ``PeftModel.from_pretrained(base, export)`` loads the trained fp32 adapters."""
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16), export
    )
    restore_kept(loaded, export)  # exact already (fp32 in the file); installs the training casts
    params = dict(loaded.named_parameters())
    for name in adapters:
        assert params[name].dtype == torch.float32, (name, params[name].dtype)
        assert torch.equal(params[name], trained[name]), name
    for name, param in params.items():  # the frozen base: the checkpoint's bf16 values
        assert name in adapters or torch.equal(param.to(trained[name].dtype), trained[name])
    files = sorted(p.name for p in export.iterdir())
    return (
        f"library export: {files}, {dict(dtypes_of(export))}; PeftModel.from_pretrained loaded "
        f"the {len(adapters)} trained fp32 adapters (bitwise)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (fp32) only")
    parser.add_argument("--output-dir", help="checkpoints and exports (default: a temp dir)")
    parser.add_argument(
        "--stop-after", type=int, help="stop after this step without saving (a preemption)"
    )
    args = parser.parse_args()
    dist.init_process_group()  # torchrun's environment; accelerate takes this group
    output_dir = shared_dir(args.output_dir)
    tmp = shared_dir(None)
    try:
        train(args, output_dir, base=tiny_checkpoint(os.path.join(tmp, "qwen3-moe")))
        dist.barrier()  # no rank tears its connections down while a peer uses them
    finally:  # no barrier on an error: a peer may be inside a collective
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            if args.output_dir is None:
                shutil.rmtree(output_dir, ignore_errors=True)
    dist.destroy_process_group()


def train(args: argparse.Namespace, output_dir: str, base: str) -> None:
    """Train (resuming from the last complete checkpoint, if any), then export."""
    rank = dist.get_rank()
    resume = last_complete_checkpoint(output_dir)  # None on the first launch
    set_seed(0)  # every rank initialises the adapters alike
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    rules = [Glob("*.mlp.gate.weight")]  # the router gates, in fp32
    if args.lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
        model = get_peft_model(model, lora, autocast_adapter_dtype=True)  # before the policy
        rules.append(Glob("*lora_*"))  # the adapters, in fp32
    policy = model_policy(
        model, PrecisionRules(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, rules=rules)
    )
    config = SFTConfig(
        output_dir=output_dir, use_cpu=True, bf16=True, fsdp="full_shard",
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["Qwen3MoeDecoderLayer"]},
        max_steps=STEPS, per_device_train_batch_size=2, logging_steps=1,
        save_strategy="steps", save_steps=SAVE_STEPS, report_to=[],
    )  # fmt: skip
    trainer_fsdp_policy(config, policy)
    g = torch.Generator().manual_seed(0)
    data = Dataset.from_dict(
        {"input_ids": torch.randint(2, VOCAB, (4 * STEPS, 16), generator=g).tolist()}
    )
    trainer = cpu_fsdp2_trainer(SFTTrainer)(
        model=model, args=config, train_dataset=data, processing_class=tokenizer()
    )
    if args.stop_after is not None:
        trainer.add_callback(Preempted(args.stop_after))
    result = trainer.train(resume_from_checkpoint=resume)
    started = f"resumed from {os.path.basename(resume)}" if resume else "started fresh"
    wrapped = trainer.model_wrapped
    trained = gathered(wrapped)  # collective
    if result.global_step < STEPS:
        if rank == 0:
            last = last_complete_checkpoint(output_dir)
            print(
                f"{started}; preempted after step {result.global_step} (parameters sha256 "
                f"{digest(trained)}), last complete checkpoint {os.path.basename(str(last))}"
            )
        return

    kept = [n for n in trained if n.endswith("mlp.gate.weight") or "lora_" in n]
    assert kept and all(trained[n].dtype == torch.float32 for n in kept)
    if rank == 0:
        losses = [f"{r['loss']:.4f}" for r in trainer.state.log_history if "loss" in r]
        print(
            f"{started}; trained to step {result.global_step} (loss per step: "
            f"{', '.join(losses)}); parameters sha256 {digest(trained)}"
        )

    # What ran: FSDP2 (every parameter a DTensor, not a DDP fallback), and the dtype FSDP
    # gathered each parameter in for one more forward.
    assert all(isinstance(p, DTensor) for p in wrapped.parameters()), "FSDP2 did not wrap it"
    with torch.no_grad(), GatherProbe(wrapped) as probe:
        wrapped(input_ids=torch.randint(2, VOCAB, (2, 16), generator=g))
    assert all(probe.seen[n].dtype == torch.float32 for n in kept)
    assert all(t.dtype == torch.bfloat16 for n, t in probe.seen.items() if n not in kept)
    if rank == 0:
        print(
            f"{len(kept)} kept parameters gathered in fp32 (router gates"
            f"{', adapters' if args.lora else ''}), the other {len(probe.seen) - len(kept)} "
            "in bf16, on FSDP2"
        )

    # The exports: the Trainer's and the library's (both collective; rank 0 writes).
    final = Path(output_dir, "final")
    trainer.save_model(str(final))
    export = Path(output_dir, "export")
    export_safetensors(
        wrapped, export, dtype=torch.bfloat16, step=result.global_step,
        max_shard_size="5GB" if args.lora else "64KB",  # several shards of the tiny model
    )  # fmt: skip
    if rank == 0:
        print(f"save_model: {dict(dtypes_of(final))} (accelerate's fp32 masters)")
        if args.lora:
            adapters = [n for n in kept if "lora_" in n]
            print(check_adapter_export(export, base, trained, adapters))
        else:
            print(check_model_export(export, trained, kept))


if __name__ == "__main__":
    main()
    # Leave without interpreter shutdown, the group destroyed and every file written: a gloo
    # worker thread can still hold the last collective's work, and freeing its tensors (which
    # needs the GIL) once the interpreter finalises aborts a rank that finished ("terminate
    # called without an active exception"). destroy_process_group does not wait for that thread
    # while the trained model's device mesh still holds the group.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
