"""Which transformers MoE architectures accept fp32 norm / router weights with bf16 activations?

Builds each architecture from its config at a tiny size, casts it to bf16, keeps either its norm
weights or its router weights in fp32 (what a kept parameter inside a bf16 FSDP unit sees: the
unit's activations stay bf16), and runs forward and backward. Prints one line per architecture.

    python scripts/screen_hf_keep.py deepseek_v3 qwen3_moe mixtral ...
"""

from __future__ import annotations

import sys
import warnings

import torch

SMALL = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 64,
    "first_k_dense_replace": 0,
    "n_group": 2,
    "topk_group": 1,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "use_cache": False,
    "pad_token_id": 0,
}
#: Multi-head latent attention: rotary embeddings span qk_rope_head_dim, which config.head_dim
#: stands for in these configs.
MLA = {"deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa", "longcat_flash"}
KINDS = {
    "norm": lambda fqn: "norm" in fqn,
    "router": lambda fqn: ".gate.weight" in fqn or "router" in fqn,
}


def screen(model_type: str) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    results = []
    for kind, kept in KINDS.items():
        try:
            overrides = {"head_dim": SMALL["qk_rope_head_dim"]} if model_type in MLA else {}
            config = AutoConfig.for_model(model_type, **{**SMALL, **overrides})
            model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
            names = [n for n, _ in model.named_parameters() if kept(n)]
            for name, param in model.named_parameters():
                if kept(name):
                    param.data = param.data.float()
            ids = torch.randint(0, 128, (2, 8))
            model(input_ids=ids, labels=ids).loss.backward()
            results.append(f"{kind}: ok ({len(names)} kept)")
        except Exception as exc:  # report and go on: this is a survey
            first = str(exc).splitlines()[0][:70]
            results.append(f"{kind}: FAIL ({type(exc).__name__}: {first})")
    return f"{model_type:<18} " + "  ".join(results)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    for name in sys.argv[1:]:
        print(screen(name), flush=True)
