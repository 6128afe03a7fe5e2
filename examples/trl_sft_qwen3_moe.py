"""Fine-tune Qwen3-MoE with TRL's SFTTrainer on FSDP2: bf16 compute, the router gates in fp32,
gradients reduced in fp32. No hook, no ``.float()``, no model surgery.

    torchrun --standalone --nproc_per_node 2 examples/trl_sft_qwen3_moe.py          # CPU, tiny
    torchrun --standalone --nproc_per_node 2 examples/trl_sft_qwen3_moe.py --lora   # + LoRA

Here a tiny Qwen3-MoE is saved and loaded the way a real checkpoint is,
``from_pretrained(dir, dtype=torch.bfloat16)``: its gates arrive in bf16, and the rule keeping
them in fp32 upcasts them exactly (the checkpoint never held more). ``Qwen3MoeTopKRouter`` calls
``F.linear`` on its input as it comes; the rule's boundary cast (``boundary="auto"``) casts it to
fp32, and the router returns fp32 logits to the model's softmax and top-k.

On GPUs: load your checkpoint instead of the tiny one, use ``SFTTrainer`` itself (not
``cpu_fsdp2_trainer``, which turns FSDP2 back on where accelerate would fall back to DDP on a
CPU-only machine), and drop ``use_cpu``. CI runs both forms of this file.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3MoeConfig
from trl import SFTConfig, SFTTrainer

from fsdp_precision import Glob, PrecisionRules, model_policy
from fsdp_precision.integrations import cpu_fsdp2_trainer, trainer_fsdp_policy
from fsdp_precision.testing import GatherProbe

VOCAB = 128


def tiny_checkpoint(directory: str) -> str:
    """A randomly initialised tiny Qwen3-MoE saved as a real checkpoint (no download)."""
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")),
        pad_token="<pad>",
        eos_token="<eos>",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (fp32) only")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))

    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_checkpoint(os.path.join(tmp, f"qwen3-moe-{rank}"))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        rules = [Glob("*.mlp.gate.weight")]  # the router gates, in fp32
        if args.lora:
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
            model = get_peft_model(model, lora, autocast_adapter_dtype=True)  # before the policy
            rules.append(Glob("*lora_*"))  # the adapters, in fp32
        policy = model_policy(
            model,
            PrecisionRules(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, rules=rules),
        )
        config = SFTConfig(
            output_dir=os.path.join(tmp, "out"), use_cpu=True, bf16=True, fsdp="full_shard",
            fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["Qwen3MoeDecoderLayer"]},
            max_steps=args.steps, per_device_train_batch_size=2, logging_steps=1,
            save_strategy="no", report_to=[],
        )  # fmt: skip
        trainer_fsdp_policy(config, policy)
        g = torch.Generator().manual_seed(0)
        data = Dataset.from_dict(
            {"input_ids": torch.randint(2, VOCAB, (8, 16), generator=g).tolist()}
        )
        trainer = cpu_fsdp2_trainer(SFTTrainer)(
            model=model, args=config, train_dataset=data, processing_class=tokenizer()
        )
        result = trainer.train()

    # What ran: FSDP2 (every parameter a DTensor, not a DDP fallback), and the dtype FSDP
    # gathered each parameter in for one more forward.
    wrapped = trainer.model_wrapped
    assert all(isinstance(p, DTensor) for p in wrapped.parameters()), "FSDP2 did not wrap it"
    ids = torch.randint(2, VOCAB, (2, 16), generator=g)
    with GatherProbe(wrapped) as probe:
        wrapped(input_ids=ids)
    kept = {n for n in probe.seen if n.endswith("mlp.gate.weight") or "lora_" in n}
    assert kept and all(probe.seen[n].dtype == torch.float32 for n in kept)
    assert all(t.dtype == torch.bfloat16 for n, t in probe.seen.items() if n not in kept)
    if rank == 0:
        trained = "LoRA adapters" if args.lora else "all parameters"
        print(
            f"trained {trained} for {result.global_step} steps, loss {result.training_loss:.4f}; "
            f"{len(kept)} kept parameters gathered in fp32 (router gates"
            f"{', adapters' if args.lora else ''}), the other {len(probe.seen) - len(kept)} in "
            "bf16, on FSDP2"
        )


if __name__ == "__main__":
    main()
