"""torchtitan, with the real package, on 2 CPU ranks (gloo), without its training loop.

torchtitan's ``apply_fsdp_to_decoder`` builds its own ``MixedPrecisionPolicy(param_dtype,
reduce_dtype)``, so the recipe is a ``parallelize_fn`` of the same unit structure that passes ONE
``fsdp_precision.model_policy`` to every call: the input embedding, the grouped
``[norm, lm_head]`` tail, each transformer block, then the root. The model is torchtitan's own
Qwen3 MoE built small from its config classes; its router gates (``*moe.router.gate.weight``)
are kept in fp32. torchtitan's own ``apply_fsdp_to_decoder`` gathers them in bf16 with the same
collectives (the negative control).

Two CPU stand-ins, both outside the units: torchtitan's language models use flex (or varlen)
attention, which has no CPU backward, so the blocks use its ``ScaledDotProductAttention``; and
its router computes the gate under ``torch.autocast(dtype=float32)``, which casts the gate's
input on CUDA but is disabled on CPU, so a forward pre-hook casts it instead. And gloo has no
PREMUL_SUM for torchtitan's gradient divide factor of 1, so the units reduce with SUM.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

import fsdp_precision as fp
from fsdp_precision.testing import CollectiveRecorder, GatherProbe

from _harness import collect_cases, distributed_suite

pytest.importorskip(
    "torchtitan.models.qwen3",
    reason="torchtitan (and triton, which its models import) is not installed: "
    "pip install torchtitan triton (docs/integrations.md, 'torchtitan')",
)

bf16, fp32 = torch.bfloat16, torch.float32
RULES = fp.PrecisionRules(
    param_dtype=bf16,
    reduce_dtype=fp32,
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


def tiny_qwen3_moe() -> Any:
    """torchtitan's Qwen3 MoE from its own config builders, 2 layers, 4 experts, on CPU."""
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
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    for layer in model.layers.values():  # what autocast(float32) does on CUDA
        layer.moe.router.gate.register_forward_pre_hook(
            lambda gate, args: (args[0].to(gate.weight.dtype), *args[1:])
        )
    return model


def sum_reductions_for_gloo(model: nn.Module) -> nn.Module:
    """torchtitan sets a gradient divide factor of 1 (a PREMUL_SUM, which gloo lacks): use SUM."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


def gates(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters() if n.endswith("moe.router.gate.weight")]


def step(model: nn.Module) -> tuple[dict[str, torch.dtype], tuple[int, int]]:
    """One forward+backward (next-token loss); gathered dtypes and collective counts."""
    gen = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=gen)
    positions = torch.arange(SEQ).repeat(2, 1)
    with CollectiveRecorder() as recorder, GatherProbe(model) as probe:
        logits = model(tokens[:, :-1], positions)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()  # type: ignore[no-untyped-call]
    assert torch.isfinite(loss), loss
    assert all(p.grad is not None for p in model.parameters())
    kinds = [c.kind for c in recorder.calls]
    seen = {n: t.dtype for n, t in probe.seen.items()}
    return seen, (kinds.count("all_gather"), kinds.count("reduce_scatter"))


def case_recipe_keeps_the_router_gates_in_fp32_with_torchtitans_units() -> None:
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    model = sum_reductions_for_gloo(parallelize_with_model_policy(tiny_qwen3_moe(), mesh, RULES))
    names = [n for n, _ in model.named_parameters()]
    not_sharded = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    assert not not_sharded, not_sharded
    kept = gates(model)
    assert len(kept) == 2, kept
    seen, counts = step(model)
    assert sorted(seen) == sorted(names)
    assert all(seen[n] == fp32 for n in kept), {n: seen[n] for n in kept}
    assert all(d == bf16 for n, d in seen.items() if n not in kept)
    # Negative control: torchtitan's own apply_fsdp_to_decoder (its policy, bf16/fp32) gathers
    # the gates in bf16, with exactly the same collectives: keeping them costs no unit.
    plain = tiny_qwen3_moe()
    apply_fsdp_to_decoder(plain, mesh, param_dtype=bf16, reduce_dtype=fp32, pp_enabled=False)
    sum_reductions_for_gloo(plain)
    assert all(isinstance(p, DTensor) for p in plain.parameters())
    plain_seen, plain_counts = step(plain)
    assert all(plain_seen[n] == bf16 for n in kept), {n: plain_seen[n] for n in kept}
    assert counts == plain_counts, (counts, plain_counts)
    assert counts[0] >= 4 and counts[1] >= 4, counts  # 2 blocks, embedding, tail, root


CASES = collect_cases(globals())

results, test_torchtitan = distributed_suite(2, __name__, CASES)
