"""The trainer's side: a Qwen3-MoE trained with the library's FSDP2 path on one gloo process
(fp32 master weights, the router gates kept in fp32), exported, and its own forward on held-out
prompts (the reference every engine is measured against)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from bench_advice_training import corpus  # Python's help text, bytes as tokens

BF16, FP32 = torch.bfloat16, torch.float32
TOP_K = 2


@dataclass(frozen=True)
class Size:
    """The model and run sizes of one mode (``--smoke`` or the full run)."""

    hidden: int  #: hidden size; heads are 32 wide (vLLM's CPU attention wants 32 or 64)
    layers: int  #: MoE layers
    experts: int  #: routed experts (top-2)
    steps: int  #: AdamW steps per seed
    batch: int  #: sequences per step
    seq: int  #: tokens per training sequence and per held-out prompt
    prompts: int  #: held-out prompts per seed


def build(size: Size, seed: int) -> torch.nn.Module:
    """A Qwen3-MoE from its transformers config, fp32, initialised from ``seed``."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    heads = size.hidden // 32
    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=size.hidden, intermediate_size=2 * size.hidden,
        moe_intermediate_size=size.hidden, num_hidden_layers=size.layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=32,
        num_experts=size.experts, num_experts_per_tok=TOP_K, max_position_embeddings=512,
        router_aux_loss_coef=0.0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=FP32)


def held_out_prompts(size: Size, seed: int) -> list[list[int]]:
    """``size.prompts`` windows of the held-out last 10% of the corpus, sampled from ``seed``."""
    data = corpus()
    held_out = data[int(0.9 * data.numel()) :]
    g = torch.Generator().manual_seed(10_000 + seed)
    starts = torch.randint(0, held_out.numel() - size.seq, (size.prompts,), generator=g)
    return [held_out[s : s + size.seq].tolist() for s in starts.tolist()]


def train_and_export(size: Size, seed: int, export: str) -> dict[str, Any]:
    """In the trainer's process (one gloo rank): train, export (bulk bf16, gates fp32, the
    record) and return the trainer's reference on the held-out prompts of ``seed``."""
    import fsdp_precision as fp
    from fsdp_precision.checkpoint import export_safetensors

    data = corpus()
    train = data[: int(0.9 * data.numel())]
    model = build(size, seed)
    rules = fp.PrecisionRules(rules=(fp.Glob("*.mlp.gate.weight"),), advice="off")
    fp.compile_param_dtype_maps(model, rules, [*model.model.layers, model]).apply()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    start, losses = time.perf_counter(), []
    for _ in range(size.steps):
        starts = torch.randint(0, train.numel() - size.seq - 1, (size.batch,), generator=g)
        ids = torch.stack([train[s : s + size.seq] for s in starts.tolist()])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - start
    export_safetensors(model, export, dtype=BF16)
    reference = reference_of(model, held_out_prompts(size, seed))
    tail = losses[-20:]
    reference["train"] = {
        "seed": seed, "steps": size.steps, "seconds": round(seconds, 1),
        "loss_first": losses[0], "loss_last": sum(tail) / len(tail),
    }  # fmt: skip
    return reference


@torch.no_grad()
def reference_of(model: torch.nn.Module, prompts: list[list[int]]) -> dict[str, Any]:
    """The trainer's own forward (bf16 compute, fp32 routers, as in training) on each prompt:
    the logprob of each actual next token; per MoE layer each token's top-2 experts (fp32 router
    logits) and whether that top-2 changes when the gate weight is rounded to bf16 (a flip)."""
    from torch.distributed.tensor import DTensor

    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        weight = module.weight
        full = (weight.full_tensor() if isinstance(weight, DTensor) else weight).float()
        hidden = args[0].reshape(-1, full.shape[1]).float()
        exact = topk(torch.nn.functional.linear(hidden, full))
        rounded = topk(torch.nn.functional.linear(hidden, full.to(BF16).float()))
        seen.append((exact, (exact != rounded).any(-1)))

    handles = [g.register_forward_hook(hook) for g in gates]
    model.eval()
    out: dict[str, Any] = {"logprobs": [], "top2": [], "flips": []}
    for prompt in prompts:
        seen.clear()
        logits = model(input_ids=torch.tensor([prompt])).logits[0].float()
        logprobs = torch.log_softmax(logits[:-1], -1)
        out["logprobs"].append(logprobs.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist())
        out["top2"].append([t.tolist() for t, _ in seen])
        out["flips"].append([f.tolist() for _, f in seen])
    for handle in handles:
        handle.remove()
    return out


def topk(logits: torch.Tensor) -> torch.Tensor:
    """Each row's top-2 expert indices, sorted (a set, comparable with ``==``)."""
    return logits.topk(TOP_K, -1).indices.sort(-1).values
