"""Rules -> plan -> wrap: a tiny DeepseekV3 whose declared router stays fp32 in bf16 units.

    python examples/plan_and_wrap.py          # one CPU process (gloo), no download

Builds the real architecture from its config, prints the plan, wraps it with FSDP2 and runs one
training step. The test suite runs this file.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from fsdp_precision import Glob, PrecisionRules, compile_param_dtype_maps
from fsdp_precision.testing import GatherProbe


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
    )
    model = DeepseekV3ForCausalLM(config)  # fp32 master weights

    # Intent: bf16 compute, fp32 reduce, and whatever the model declares in fp32. DeepseekV3
    # declares _keep_in_fp32_modules_strict = ["e_score_correction_bias", "gate.weight"]: its
    # router casts activations to fp32 itself. (A rule like Glob("*norm.weight") would not be
    # safe here: DeepseekV3's RMSNorm returns weight * x, which an fp32 weight promotes to fp32
    # activations that the next bf16 Linear rejects. Mapped parameters never cast activations.)
    rules = PrecisionRules(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        rules=(Glob("model.layers.*.mlp.gate.weight"),),  # same as declared: claimed here first
    )
    plan = compile_param_dtype_maps(model, rules)  # one unit per decoder layer, then the root
    print(plan.explain())

    plan.apply()  # applies the patch and calls fully_shard per unit, innermost first
    ids = torch.randint(0, config.vocab_size, (2, 8))
    with GatherProbe(model) as probe:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    gate = probe.seen["model.layers.1.mlp.gate.weight"]
    proj = probe.seen["model.layers.1.self_attn.q_a_proj.weight"]
    print(f"\nloss {loss.item():.4f}; router gathered in {gate.dtype}, q_a_proj in {proj.dtype}")
    assert gate.dtype == torch.float32 and proj.dtype == torch.bfloat16
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
