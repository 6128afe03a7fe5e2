"""The trainer's side: a Qwen3-MoE trained with the library's FSDP2 path on one gloo process
(fp32 master weights, the router gates kept in fp32), exported, and its own forward on held-out
prompts (the reference every engine is measured against); later, the same trained model again,
its forward replaying each engine's routes (``fsdp_precision.replay``), and what replay costs a
training step."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
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
    cost_pairs: int = 20  #: replay's cost: pairs of training steps with and without replay


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


def sharded(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` under the library's FSDP2 path: bf16 compute, the router gates kept in fp32."""
    import fsdp_precision as fp

    rules = fp.PrecisionRules(rules=(fp.Glob("*.mlp.gate.weight"),), advice="off")
    fp.compile_param_dtype_maps(model, rules, [*model.model.layers, model]).apply()
    return model


def train_and_export(size: Size, seed: int, export: str, state: str) -> dict[str, Any]:
    """In the trainer's process (one gloo rank): train, export (bulk bf16, gates fp32, the
    record), save the fp32 weights to ``state`` (for :func:`replay_pass`) and return the
    trainer's reference on the held-out prompts of ``seed``."""
    from torch.distributed.tensor import DTensor

    from fsdp_precision.checkpoint import export_safetensors

    data = corpus()
    train = data[: int(0.9 * data.numel())]
    model = sharded(build(size, seed))
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
    full = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }
    torch.save(full, state)
    reference = reference_of(model, held_out_prompts(size, seed))
    tail = losses[-20:]
    reference["train"] = {
        "seed": seed, "steps": size.steps, "seconds": round(seconds, 1),
        "loss_first": losses[0], "loss_last": sum(tail) / len(tail),
    }  # fmt: skip
    return reference


@torch.no_grad()
def reference_of(
    model: torch.nn.Module, prompts: list[list[int]], routes: list[Any] | None = None
) -> dict[str, Any]:
    """The trainer's own forward (bf16 compute, fp32 routers, as in training) on each prompt:
    the logprob of each actual next token; per MoE layer each token's top-2 experts (fp32 router
    logits) and whether that top-2 changes when the gate weight is rounded to bf16 (a flip).
    With ``routes`` (one engine's ``routed_experts`` per prompt), the forward replays them, and
    ``top2`` is what the routers picked (the engine's ids, checked)."""
    from torch.distributed.tensor import DTensor

    from fsdp_precision import replay

    replaying = replay.RoutingReplay(model) if routes is not None else None

    named = [(n, m) for n, m in model.named_modules() if n.endswith("mlp.gate")]
    gates = [m for _, m in named]
    gates_layers = [int(n.split(".")[2]) for n, _ in named]
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        weight = module.weight
        full = (weight.full_tensor() if isinstance(weight, DTensor) else weight).float()
        hidden = args[0].reshape(-1, full.shape[1]).float()
        exact = topk(torch.nn.functional.linear(hidden, full))
        rounded = topk(torch.nn.functional.linear(hidden, full.to(BF16).float()))
        seen.append((exact, (exact != rounded).any(-1)))

    picked: list[torch.Tensor] = []
    handles = [g.register_forward_hook(hook) for g in gates]
    handles += [g.register_forward_hook(lambda m, a, o: picked.append(o[2])) for g in gates]
    model.eval()
    out: dict[str, Any] = {"logprobs": [], "top2": [], "flips": []}
    for p, prompt in enumerate(prompts):
        seen.clear()
        picked.clear()
        ids = torch.tensor([prompt])
        if replaying is None:
            logits = model(input_ids=ids).logits[0].float()
        else:
            # the engine's rows: prompt + 1 generated token - 1 = one per prompt token; the
            # trainer's tokens are the prompt, the generated token cut off (truncation)
            engine_rows = np.asarray(routes[p], dtype=np.uint8)  # JSON carried vLLM's uint8
            sequence = replay.from_vllm(engine_rows, replaying.shape)
            batch = replay.batch_routes(
                [sequence], replaying.shape, attention_mask=torch.ones_like(ids), truncation="right"
            )
            with replaying.routes(batch):
                logits = model(input_ids=ids).logits[0].float()
            for layer, ids_of_layer in enumerate(picked):
                want = sequence[:, gates_layers[layer]].long()
                assert torch.equal(ids_of_layer, want), f"prompt {p} layer {layer}"
            seen[:] = [(i.sort(-1).values, f) for i, (_, f) in zip(picked, seen, strict=True)]
        logprobs = torch.log_softmax(logits[:-1], -1)
        out["logprobs"].append(logprobs.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist())
        out["top2"].append([t.tolist() for t, _ in seen])
        out["flips"].append([f.tolist() for _, f in seen])
    for handle in handles:
        handle.remove()
    if replaying is not None:
        replaying.remove()
    return out


def topk(logits: torch.Tensor) -> torch.Tensor:
    """Each row's top-2 expert indices, sorted (a set, comparable with ``==``)."""
    return logits.topk(TOP_K, -1).indices.sort(-1).values


def replay_pass(
    size: Size, seed: int, state: str, routes: dict[str, list[Any]], cost_pairs: int
) -> dict[str, Any]:
    """In a trainer's process: the trained model again (``state``), its forward on the held-out
    prompts live and replaying each engine's routes, and replay's cost per training step
    (forward + backward with and without replay, ``cost_pairs`` pairs, interleaved, order
    alternating within a pair; the ratio of medians)."""
    from fsdp_precision import replay

    model = build(size, seed)
    model.load_state_dict(torch.load(state, weights_only=True))
    model = sharded(model)
    prompts = held_out_prompts(size, seed)
    out = {"live": reference_of(model, prompts)}
    out |= {name: reference_of(model, prompts, r) for name, r in routes.items()}
    model.train()
    data = corpus()
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - size.seq, (size.batch,), generator=g)
    ids = torch.stack([data[s : s + size.seq] for s in starts.tolist()])
    picked: dict[int, torch.Tensor] = {}
    gates = {int(n.split(".")[2]): m for n, m in model.named_modules() if n.endswith("mlp.gate")}
    handles = [
        m.register_forward_hook(lambda mod, a, o, i=i: picked.__setitem__(i, o[2]))
        for i, m in gates.items()
    ]
    with torch.no_grad():
        model(input_ids=ids)
    for handle in handles:
        handle.remove()
    live = torch.zeros(ids.numel(), size.layers, TOP_K, dtype=torch.int16)
    for layer, chosen in picked.items():
        live[:, layer] = chosen.to(torch.int16)
    replaying = replay.RoutingReplay(model)

    def step(with_replay: bool) -> float:
        start = time.perf_counter()
        if with_replay:
            with replaying.routes(live):
                model(input_ids=ids, labels=ids).loss.backward()
        else:
            with replaying.live():
                model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    step(True), step(False)  # warm-up
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(cost_pairs):
        for flag in (i % 2 == 0, i % 2 != 0):
            times[flag].append(step(flag))
    replaying.remove()
    median = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    out["cost"] = {
        "pairs": cost_pairs,
        "tokens_per_step": ids.numel(),
        "seconds_median": {"replay": median[True], "live": median[False]},
        "replay_over_live": median[True] / median[False],
    }
    return out
