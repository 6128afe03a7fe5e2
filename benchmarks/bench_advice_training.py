"""Does the measured advice predict training? A tiny Qwen3-MoE trained from scratch on real text,
in five precision layouts side by side, next to what ``advise(..., measure=True)`` predicted.

    python benchmarks/bench_advice_training.py [--steps 3000] [--eval-every 250] [--seed 0]
        [--json PATH] [--plot PATH] [--smoke]

The model: ``Qwen3MoeForCausalLM`` from its transformers config (2 layers, 8 experts, top-2,
hidden 64), bytes as tokens (vocabulary 256). The corpus: the interpreter's own help text
(``pydoc_data.topics``, about 0.8 MB of English that ships with Python), the last 10% held out.

Five copies of one initialisation, each wrapped with FSDP2 (one gloo rank; a unit per decoder
layer and the root) from a compiled plan, train on the same batches in the same order with AdamW
(fp32 master weights, gradients reduced in fp32); every step steps each copy once, in an order
reversed every other step:

- ``bf16``: everything computes in bf16 (no rule, no declaration);
- ``routers``: the router gates kept in fp32 (``Glob("*.mlp.gate.weight")``);
- ``norms``: the norm weights kept in fp32 (``Glob("*norm.weight")``);
- ``kept``: both (what the advisor's candidates amount to for this model);
- ``fp32``: everything in fp32.

At step 0, mid-training and at the end, ``fsdp_precision.advise(model, batches, measure=True)``
runs on the fp32 copy's weights (gathered to an unsharded fp32 model) and on the bf16 copy's,
on 8 held-out batches: per candidate its effect (the share of bf16's logits KL that keeping it
alone removes) and the routers' expert flips. Every ``--eval-every`` steps each copy is
evaluated on the held-out batches in its own precision: loss, and expert load (the busiest
expert's share of routed tokens over the mean share, 1.0 = balanced). Step times are paired
ratios (layout / bf16 in the same step), medians. ``--smoke``: 6 steps, the same code path.
Prints JSON; ``--plot`` draws the held-out loss curves (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_precision as fp
from fsdp_precision.testing import launch, process_group

BF16, FP32 = torch.bfloat16, torch.float32
ROUTERS, NORMS = fp.Glob("*.mlp.gate.weight"), fp.Glob("*norm.weight")
LAYOUTS: dict[str, tuple[torch.dtype, tuple[fp.Glob, ...]]] = {
    "bf16": (BF16, ()),
    "routers": (BF16, (ROUTERS,)),
    "norms": (BF16, (NORMS,)),
    "kept": (BF16, (ROUTERS, NORMS)),
    "fp32": (FP32, ()),
}


def corpus() -> torch.Tensor:
    """The interpreter's help text as bytes."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def batch(data: torch.Tensor, g: torch.Generator, size: int, seq: int) -> dict[str, torch.Tensor]:
    starts = torch.randint(0, data.numel() - seq - 1, (size,), generator=g)
    ids = torch.stack([data[s : s + seq] for s in starts.tolist()])
    return {"input_ids": ids, "labels": ids}


def build(seed: int, smoke: bool) -> nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=32 if smoke else 64, intermediate_size=128,
        moe_intermediate_size=32 if smoke else 64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=256, router_aux_loss_coef=0.0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=FP32)


def wrap(model: nn.Module, layout: str) -> nn.Module:
    dtype, rules = LAYOUTS[layout]
    precision = fp.PrecisionRules(
        param_dtype=dtype, reduce_dtype=FP32, rules=rules, hf_keep_in_fp32=False, advice="off"
    )
    units = [*model.model.layers, model]
    return fp.compile_param_dtype_maps(model, precision, units).apply()


def unsharded(model: nn.Module, template: nn.Module) -> nn.Module:
    """An unsharded fp32 copy of ``model``'s current weights (``template``: same architecture)."""
    full = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float()
        for n, p in model.named_parameters()
    }
    missing, unexpected = template.load_state_dict(full, strict=False)
    buffers = {n for n, _ in template.named_buffers()}
    assert not unexpected and set(missing) <= buffers, (missing, unexpected)
    return template


def predicted(model: nn.Module, template: nn.Module, batches: list[Any]) -> dict[str, Any]:
    advice = fp.advise(unsharded(model, template), batches, measure=True)
    assert advice.measured is not None
    out: dict[str, Any] = {"kl_uniform": advice.measured.uniform.kl}
    for f in advice.measured.figures:
        out[f.candidate.pattern] = {
            "kind": f.candidate.kind,
            "effect": f.effect,
            "flips": f.flips,
            "module_error": f.module_error,
        }
    return out


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[Any]) -> dict[str, float]:
    loads: list[torch.Tensor] = []

    def count(module: nn.Module, args: Any, output: Any) -> None:
        chosen = output[2].reshape(-1)
        loads.append(torch.bincount(chosen, minlength=module.num_experts).float())

    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    handles = [g.register_forward_hook(count) for g in gates]
    model.eval()
    losses = [float(model(**b).loss) for b in batches]
    model.train()
    for handle in handles:
        handle.remove()
    per_layer = [sum(loads[i :: len(gates)]) for i in range(len(gates))]
    imbalance = statistics.mean(float(c.max() / c.mean()) for c in per_layer)
    return {"loss": statistics.mean(losses), "max_load_over_mean": imbalance}


def worker(args: argparse.Namespace) -> dict[str, Any]:
    with process_group():
        return run(args)


def run(args: argparse.Namespace) -> dict[str, Any]:
    data = corpus()
    cut = int(data.numel() * 0.9)
    train, held = data[:cut], data[cut:]
    size, seq = (4, 32) if args.smoke else (16, 64)
    held_g = torch.Generator().manual_seed(1234)
    held_out = [batch(held, held_g, size, seq) for _ in range(2 if args.smoke else 8)]
    models = {name: wrap(build(args.seed, args.smoke), name) for name in LAYOUTS}
    template = build(args.seed, args.smoke)
    optims = {n: torch.optim.AdamW(m.parameters(), lr=2e-3) for n, m in models.items()}
    g = torch.Generator().manual_seed(args.seed)
    mid = args.steps // 2
    predictions = {"step_0": {"fp32": predicted(models["fp32"], template, held_out)}}
    curves: dict[str, list[dict[str, float]]] = {n: [] for n in LAYOUTS}
    train_loss: dict[str, list[float]] = {n: [] for n in LAYOUTS}
    ratios: dict[str, list[float]] = {n: [] for n in LAYOUTS if n != "bf16"}
    for step in range(1, args.steps + 1):
        inputs = batch(train, g, size, seq)
        order = list(LAYOUTS) if step % 2 else list(reversed(LAYOUTS))
        times = {}
        for name in order:
            start = time.perf_counter()
            loss = models[name](**inputs).loss
            loss.backward()
            optims[name].step()
            optims[name].zero_grad(set_to_none=True)
            times[name] = time.perf_counter() - start
            train_loss[name].append(float(loss.detach()))
        for name in ratios:
            ratios[name].append(times[name] / times["bf16"])
        if step % args.eval_every == 0 or step == args.steps:
            for name, model in models.items():
                curves[name].append({"step": step, **evaluate(model, held_out)})
        if step in (mid, args.steps):
            key = "mid" if step == mid else "end"
            predictions[key] = {
                n: predicted(models[n], template, held_out) for n in ("fp32", "bf16")
            }
    final = {n: c[-1]["loss"] for n, c in curves.items()}
    gap = final["bf16"] - final["fp32"]
    return {
        "steps": args.steps,
        "tokens_per_step": size * seq,
        "final_eval_loss": final,
        "gap_closed": {n: (final["bf16"] - final[n]) / gap if gap else None for n in LAYOUTS},
        "step_time_vs_bf16": {n: statistics.median(r) for n, r in ratios.items()},
        "curves": curves,
        "train_loss_last_100": {n: statistics.mean(v[-100:]) for n, v in train_loss.items()},
        "predicted": predictions,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, curve in result["curves"].items():
        steps = [c["step"] for c in curve]
        left.plot(steps, [c["loss"] for c in curve], label=name)
        right.plot(steps, [c["max_load_over_mean"] for c in curve], label=name)
    left.set(xlabel="step", ylabel="held-out loss (nats/byte)", title="held-out loss")
    right.set(xlabel="step", ylabel="busiest expert / mean", title="expert load")
    tail = [c["loss"] for curve in result["curves"].values() for c in curve[len(curve) // 3 :]]
    left.set_ylim(min(tail) - 0.05, max(tail) + 0.1)
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    parser.add_argument("--plot", type=Path, default=None, help="draw the curves (matplotlib)")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.eval_every = 6, 3
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    result = launch(worker, (args,), nproc=1)
    result["seconds"] = time.perf_counter() - start
    result["machine"] = f"{platform.processor() or platform.machine()}, torch {torch.__version__}"
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
