"""transformers' own FSDP2 (``from_pretrained(..., distributed_config=...)``) with the opt-in:
Qwen3-MoE loaded in bf16, its router gates kept in fp32, gradients reduced in fp32.

    torchrun --standalone --nproc_per_node 2 examples/transformers_native_qwen3_moe.py  # CPU

transformers wraps the model itself while loading it and hands every ``fully_shard`` call one
hard-coded ``MixedPrecisionPolicy(bf16, fp32)``; inside ``transformers_native_fsdp(rules)`` every
call gets ``model_policy(model, rules)`` instead. The checkpoint's gates are bf16: the rule keeps
them in fp32 by upcasting them exactly, and its boundary cast casts the router's input. A tiny
checkpoint is written first (no download); use your own path. CI runs this file.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor

from fsdp_precision import Glob, PrecisionRules
from fsdp_precision.integrations import transformers_native_fsdp
from fsdp_precision.testing import GatherProbe

VOCAB = 128


def tiny_checkpoint() -> str:
    """Rank 0 saves a randomly initialised tiny Qwen3-MoE; every rank gets the path."""
    where = [tempfile.mkdtemp() if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(where, src=0)
    path = os.path.join(where[0], "qwen3-moe")
    if dist.get_rank() == 0:
        config = transformers.Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        )  # fmt: skip
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    dist.barrier()
    return path


def main() -> None:
    dist.init_process_group("gloo")
    path = tiny_checkpoint()
    rules = PrecisionRules(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, rules=(Glob("*.mlp.gate.weight"),)
    )
    with transformers_native_fsdp(rules):  # every fully_shard call gets model_policy
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path,
            dtype=torch.bfloat16,
            distributed_config=transformers.DistributedConfig(
                fsdp_size=dist.get_world_size(), fsdp_mixed_precision=True
            ),
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, 16), generator=g)
        with GatherProbe(model) as probe:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(isinstance(p, DTensor) for p in model.parameters()), "FSDP2 did not wrap it"
    kept = {n for n in probe.seen if n.endswith("mlp.gate.weight")}
    assert kept and all(probe.seen[n].dtype == torch.float32 for n in kept)
    assert all(t.dtype == torch.bfloat16 for n, t in probe.seen.items() if n not in kept)
    if dist.get_rank() == 0:
        print(
            f"2 steps, loss {loss.item():.4f}; {len(kept)} router gates gathered in fp32, the "
            f"other {len(probe.seen) - len(kept)} parameters in bf16, on transformers' FSDP2"
        )
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
