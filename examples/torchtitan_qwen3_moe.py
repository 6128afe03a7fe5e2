"""torchtitan with one ``model_policy``: the ``parallelize_fn`` of its Qwen3 MoE, the router gates
in fp32 inside bf16 FSDP units, gradients reduced in fp32.

    torchrun --standalone --nproc_per_node 2 examples/torchtitan_qwen3_moe.py   # CPU, tiny

torchtitan's ``apply_fsdp_to_decoder`` builds its own ``MixedPrecisionPolicy``; the recipe makes
the same calls (embedding, ``[norm, lm_head]``, each block, the root) with one ``model_policy``,
and goes in the model's ``ModelSpec.parallelize_fn`` (``parallelize_qwen3_with_model_policy``,
torchtitan's signature; set ``--parallelism.spmd_backend partial_dtensor``). On CUDA torchtitan
computes the gate under ``autocast(float32)``; the rule's boundary cast casts the gate's input on
any device. Here ``main`` builds torchtitan's own Qwen3 MoE small on CPU (its SDPA attention:
flex attention has no CPU backward) and trains two steps. ``tests/integrations/test_torchtitan.py``
imports the recipe from this file; CI runs it in its torchtitan venv.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

import fsdp_precision as fp
from fsdp_precision.testing import GatherProbe

RULES = fp.PrecisionRules(
    param_dtype=torch.bfloat16,
    reduce_dtype=torch.float32,
    cast_forward_inputs=False,  # as apply_fsdp_to_decoder
    rules=(fp.Glob("*moe.router.gate.weight"),),
)
VOCAB, SEQ = 64, 8


def parallelize_with_model_policy(model: Any, dp_mesh: Any, rules: fp.PrecisionRules) -> Any:
    """The recipe: apply_fsdp_to_decoder's units (no weight tying, no EP), one model_policy."""
    from torchtitan.distributed.fsdp import disable_fsdp_gradient_division

    policy = fp.model_policy(model, rules)
    fully_shard(model.tok_embeddings, mesh=dp_mesh, mp_policy=policy)
    fully_shard([model.norm, model.lm_head], mesh=dp_mesh, mp_policy=policy,
                reshard_after_forward=False)  # fmt: skip
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    disable_fsdp_gradient_division(model)
    return model


def parallelize_qwen3_with_model_policy(
    model: Any, *, parallel_dims: Any, training: Any, parallelism: Any, skip_dp: bool = False,
    **rest: Any,
) -> Any:  # fmt: skip
    """A ``ModelSpec.parallelize_fn`` with torchtitan's signature: its ``parallelize_qwen3``
    without the FSDP step (TP/EP/CP, activation checkpointing, compile), then the recipe's
    units with the job config's dtypes and the router gates in fp32."""
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.models.qwen3 import parallelize_qwen3

    if not skip_dp and (parallelism.spmd_backend != "partial_dtensor" or parallel_dims.ep_enabled):
        raise ValueError(
            f"this recipe covers spmd_backend='partial_dtensor' without expert parallelism, got "
            f"{parallelism.spmd_backend!r} with ep={parallel_dims.ep}: set "
            "--parallelism.spmd_backend partial_dtensor and expert_parallel_degree 1"
        )
    parallelize_qwen3(model, parallel_dims=parallel_dims, training=training,
                      parallelism=parallelism, skip_dp=True, **rest)  # fmt: skip
    if skip_dp:
        return model
    rules = fp.PrecisionRules(
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        cast_forward_inputs=False,
        rules=(fp.Glob("*moe.router.gate.weight"),),
    )
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    return parallelize_with_model_policy(model, parallel_dims.get_mesh(names), rules)


def tiny_qwen3_moe_config() -> Any:
    """torchtitan's Qwen3 MoE config from its own builders, 2 layers, 4 experts, CPU attention."""
    from torchtitan.models import qwen3
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.rope import CosSinRoPE

    dim, head_dim = 32, 16
    config = qwen3.Qwen3Model.Config(
        vocab_size=VOCAB, dim=dim, norm=qwen3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT
        ),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=qwen3._LINEAR_INIT),
        layers=qwen3._build_qwen3_moe_layers(
            n_layers=2, dim=dim, n_heads=2, n_kv_heads=1, head_dim=head_dim, moe_hidden_dim=48,
            num_experts=4, top_k=2, attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=4 * SEQ, theta=1e6),
        ),
    )  # fmt: skip
    for layer in config.layers:  # flex attention has no CPU backward
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    torch.manual_seed(0)
    model = tiny_qwen3_moe_config().build()
    model.init_states()
    parallelize_with_model_policy(model, mesh, RULES)
    for module in model.modules():  # gloo has no PREMUL_SUM for torchtitan's divide factor 1
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
        with GatherProbe(model) as probe:
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), tokens[:, 1:].flatten()
            )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(isinstance(p, DTensor) for p in model.parameters()), "FSDP2 did not wrap it"
    kept = {n for n in probe.seen if n.endswith("moe.router.gate.weight")}
    assert kept and all(probe.seen[n].dtype == torch.float32 for n in kept)
    assert all(t.dtype == torch.bfloat16 for n, t in probe.seen.items() if n not in kept)
    if dist.get_rank() == 0:
        print(
            f"2 steps, loss {loss.item():.4f}; {len(kept)} router gates gathered in fp32, the "
            f"other {len(probe.seen) - len(kept)} parameters in bf16, on FSDP2"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
