"""Lightning Fabric's ``ModelParallelStrategy`` with one ``model_policy`` in its
``parallelize_fn``: Qwen3-MoE in bf16, router gates and norms in fp32, fp32 gradient reduction.

    torchrun --standalone --nproc_per_node 2 examples/lightning_fabric_qwen3_moe.py   # CPU, tiny

Lightning leaves the ``fully_shard`` calls to ``parallelize_fn``; make them on the
``"data_parallel"`` mesh with one policy. Set ``data_parallel_size`` explicitly (its ``"auto"``
is the number of nodes: on one node nothing would be sharded) and keep ``precision`` at its
default ``"32-true"``: the policy sets what is gathered and reduced. On GPUs use
``accelerator="cuda"``. CI runs this file.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from fsdp_precision import Glob, PrecisionRules, model_policy
from fsdp_precision.testing import GatherProbe

VOCAB = 128
RULES = PrecisionRules(
    param_dtype=torch.bfloat16,
    reduce_dtype=torch.float32,
    rules=(Glob("*.mlp.gate.weight"), Glob("*norm.weight")),
)


def parallelize(model: nn.Module, device_mesh: object) -> nn.Module:
    """Fabric's parallelize_fn (the Trainer's configure_model makes the same calls)."""
    policy = model_policy(model, RULES)
    mesh = device_mesh["data_parallel"]  # type: ignore[index]
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def main() -> None:
    dist.init_process_group("gloo")  # torchrun's processes; Fabric attaches to them
    world = dist.get_world_size()
    strategy = ModelParallelStrategy(
        parallelize_fn=parallelize, data_parallel_size=world, tensor_parallel_size=1
    )
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = fabric.setup(AutoModelForCausalLM.from_config(config))  # calls parallelize
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(fabric.global_rank)
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, 16), generator=g)
        with GatherProbe(model) as probe:
            loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    assert all(isinstance(p, DTensor) for p in model.parameters()), "FSDP2 did not wrap it"
    kept = {n for n in probe.seen if n.endswith(("mlp.gate.weight", "norm.weight"))}
    assert kept and all(probe.seen[n].dtype == torch.float32 for n in kept)
    assert all(t.dtype == torch.bfloat16 for n, t in probe.seen.items() if n not in kept)
    if fabric.global_rank == 0:
        print(
            f"2 steps, loss {loss.item():.4f}; {len(kept)} gates and norms gathered in fp32, "
            f"the other {len(probe.seen) - len(kept)} parameters in bf16, on FSDP2"
        )


if __name__ == "__main__":
    main()
