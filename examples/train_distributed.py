"""Train a tiny GPT-OSS with wrap_model_for_training: FSDP units by size, fp32 norms, bf16 compute.

    python examples/train_distributed.py                                  # 1 CPU process
    torchrun --standalone --nproc_per_node 2 examples/train_distributed.py   # 2 processes

The test suite runs the one-process form.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from transformers import GptOssConfig, GptOssForCausalLM

from fsdp_precision import (
    DistributedConfig,
    Glob,
    PrecisionRules,
    make_grad_scaler,
    plan_model_for_training,
    wrap_model_for_training,
)


def main() -> None:
    if "RANK" not in os.environ:  # plain `python`: a one-process group
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29562")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)  # one GPU per process, before any collective
    dist.init_process_group()  # gloo for CPU tensors, NCCL for CUDA ones where torch has it
    rank = dist.get_rank()

    torch.manual_seed(0)
    model = GptOssForCausalLM(
        GptOssConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        )
    )
    config = DistributedConfig(
        parallel_strategy="fsdp",
        # bf16 compute, fp32 reduce. GptOssRMSNorm computes in fp32 and casts its output back to
        # the input dtype, so its weight can stay fp32 inside bf16 units. (LlamaRMSNorm returns
        # weight * x instead: an fp32 weight would turn the activations fp32. Check a model's
        # norm before keeping it.)
        fsdp_mixed_precision=PrecisionRules(rules=(Glob("*norm.weight"),)),
        fsdp_auto_wrap_min_params=20_000,  # each decoder layer becomes a unit
    )
    if rank == 0:
        print(plan_model_for_training(model, config).explain())
    model = wrap_model_for_training(model, config)
    scaler = make_grad_scaler(config)  # None for bf16; a ShardedGradScaler for fp16
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)

    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    g = torch.Generator().manual_seed(rank)
    for step in range(3):
        ids = torch.randint(0, 128, (4, 16), generator=g).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(optim)
            scaler.update()
        else:
            optim.step()
        optim.zero_grad()
        if rank == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}")
    norm = model.model.layers[0].input_layernorm.weight
    if rank == 0:
        print(f"norm weight stored {norm.dtype}, sharded over {norm.device_mesh.size()} rank(s)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
