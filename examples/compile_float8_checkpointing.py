"""The production recipe: compiled blocks, float8 all-gathers, activation checkpointing, and the
MoE routers kept in fp32 inside bf16 FSDP units.

    torchrun --standalone --nproc_per_node 2 examples/compile_float8_checkpointing.py
    torchrun --standalone --nproc_per_node 2 examples/compile_float8_checkpointing.py \
        --backend inductor

Qwen3-MoE at a tiny size from its transformers config class. The decoder layers' attention and
shared projections become torchao ``Float8Linear`` (float8 all-gather: 1 byte per element; the
routers are left out of the conversion), each layer is wrapped in ``checkpoint_wrapper``, then
``wrap_model_for_training`` makes one FSDP unit per layer and compiles it
(``compile_units``): the routers stay inside their layers' units, computing in fp32 with their
boundary cast, so a compiled layer is one graph. On GPUs: drop ``use_cache`` and the CPU-only
``experts_implementation`` line, keep the rest.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import DTensor
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import fsdp_precision as fp
from fsdp_precision.testing import CollectiveRecorder, GatherProbe

VOCAB = 128


def build() -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, use_cache=False,
    )  # fmt: skip
    config._experts_implementation = "batched_mm"  # CPU: grouped_mm wants 16-byte alignment
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    # float8 training for the layers' projections; the routers (mlp.gate) stay out of it
    convert_to_float8_training(
        model.model.layers,
        config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
        module_filter_fn=lambda module, fqn: "mlp.gate" not in fqn,
    )
    for i, layer in enumerate(model.model.layers):  # activation checkpointing per layer
        model.model.layers[i] = checkpoint_wrapper(layer)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("aot_eager", "inductor"), default="aot_eager")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    model = build()
    config = fp.DistributedConfig(
        fsdp_mixed_precision=fp.PrecisionRules(rules=(fp.Glob("*.mlp.gate.weight"),)),
        fsdp_auto_wrap_policy="transformer_block",
        fsdp_transformer_block_classes=("CheckpointWrapper",),
        compile_units=args.backend,
    )
    model = fp.wrap_model_for_training(model, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(args.steps):
        ids = torch.randint(0, VOCAB, (2, 16), generator=g)
        with GatherProbe(model) as probe, CollectiveRecorder() as recorder:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(isinstance(p, DTensor) for p in model.parameters()), "FSDP2 did not wrap it"
    gates = {n for n in probe.seen if n.endswith("mlp.gate.weight")}
    assert gates and all(probe.seen[n].dtype == torch.float32 for n in gates)
    float8 = sum(1 for _, m in model.named_modules() if type(m).__name__ == "Float8Linear")
    if dist.get_rank() == 0:
        gathers = recorder.of("all_gather")
        print(
            f"{args.steps} steps ({args.backend}), loss {loss.item():.4f}: {len(gates)} router "
            f"gates gathered in fp32, {float8} Float8Linear layers, "
            f"{len(gathers)} all-gathers in the last step (bytes: "
            f"{', '.join(str(c.output_bytes) for c in gathers)})"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter shutdown: gloo's threads can abort a rank that finished
