"""accelerate's FSDP2 plugin with one ``model_policy``: Qwen3-MoE in bf16, router gates and norms
in fp32, gradients reduced in fp32.

    torchrun --standalone --nproc_per_node 2 examples/accelerate_qwen3_moe.py   # CPU, tiny

accelerate makes every ``fully_shard`` call itself (each decoder layer, the embedding, a grouped
``[final norm, lm_head]`` call, the root) with the one policy object; the policy resolves each
call's parameters. The norms return ``weight * x`` and the router calls ``F.linear`` on its
input as it comes: the rules' boundary casts (``boundary="auto"``) cast their inputs to fp32 and
the norms' outputs back to bf16. On GPUs drop ``cpu=True`` and ``accelerate_fsdp2_on_cpu`` (on a
CPU-only machine accelerate would fall back to DDP). CI runs this file.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from fsdp_precision import Glob, PrecisionRules, model_policy
from fsdp_precision.integrations import accelerate_fsdp2_on_cpu
from fsdp_precision.testing import GatherProbe

VOCAB = 128


def main() -> None:
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)  # fp32 master weights
    rules = PrecisionRules(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        rules=(Glob("*.mlp.gate.weight"), Glob("*norm.weight")),
    )
    policy = model_policy(model, rules)  # on the model you prepare, before prepare
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, mixed_precision_policy=policy, auto_wrap_policy="transformer_based_wrap"
    )
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", fsdp_plugin=plugin)
    accelerate_fsdp2_on_cpu(accelerator, plugin)  # CPU only
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    g = torch.Generator().manual_seed(accelerator.process_index)
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, 16), generator=g)
        with GatherProbe(model) as probe:  # what FSDP gathered each parameter in
            loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    assert all(isinstance(p, DTensor) for p in model.parameters()), "FSDP2 did not wrap it"
    kept = {n for n in probe.seen if n.endswith(("mlp.gate.weight", "norm.weight"))}
    assert kept and all(probe.seen[n].dtype == torch.float32 for n in kept)
    assert all(t.dtype == torch.bfloat16 for n, t in probe.seen.items() if n not in kept)
    if accelerator.is_main_process:
        print(
            f"2 steps, loss {loss.item():.4f}; {len(kept)} gates and norms gathered in fp32, "
            f"the other {len(probe.seen) - len(kept)} parameters in bf16, on FSDP2"
        )


if __name__ == "__main__":
    main()
