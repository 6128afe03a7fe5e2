"""What measuring the advice costs: wall time and peak memory of ``advise(model, batches,
measure=True)`` beside one plain forward of the same model on the same batches.

    python benchmarks/bench_measure.py [--iters 2] [--hidden 512] [--layers 4] [--experts 16]
        [--vocab 8192] [--smoke]

A Qwen3-MoE from its transformers config (fp32, random weights; about 63M parameters at the
defaults) and 4 batches of 4 x 128 random tokens. Each variant runs in a fresh process, so its
peak resident memory (``resource.getrusage``) is its own; the variants alternate, their order
reversed every other iteration:

- ``forward``: build the model, run it on every batch without gradients;
- ``forward_bf16``: the same with the model cast to bf16 first (the baseline taken after the
  cast): what bf16 compute alone holds on this machine (CPU bf16 kernels hold more transient
  memory than fp32 ones);
- ``measure``: build the model, ``advise(model, batches, measure=True)``.

Reported: medians of the wall time after the build and of the peak memory above the
process's memory after the build, and the measurement's extra peak over each forward's, in
units of the model's fp32 bytes and of one fp32 copy of a batch's logits: what it holds
beyond a forward (one module's bf16 copy at a time, the reference logits and a configuration's,
a module run again), never a second model. ``--vocab 151936`` (Qwen3's) makes the logits the
largest thing held. ``--smoke``: a tiny
model, one iteration. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

VARIANTS = ("forward", "forward_bf16", "measure")


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def child(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    import fsdp_precision as fp

    config = Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8,
        num_experts=args.experts, num_experts_per_tok=2, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    seq = 32 if args.smoke else 128
    ids = [torch.randint(0, args.vocab, (4, seq), generator=g) for _ in range(4)]
    batches = [{"input_ids": x, "labels": x} for x in ids]
    if args.child == "forward_bf16":
        model = model.to(torch.bfloat16)
    built = _rss_kib()
    start = time.perf_counter()
    if args.child in ("forward", "forward_bf16"):
        with torch.no_grad():
            for b in batches:
                model(**b)
        figures = None
    else:
        advice = fp.advise(model, batches, measure=True)
        assert advice.measured is not None and advice.measured.figures
        figures = len(advice.measured.figures)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {
        "seconds": seconds,
        "peak_above_build_mib": (peak - built) / 1024,
        "model_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
        "parameters": sum(p.numel() for p in model.parameters()),
        "candidates": figures,
        "batch_logits_mib": batches[0]["input_ids"].numel() * args.vocab * 4 / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--child", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.iters, args.hidden, args.layers, args.experts = 1, 64, 2, 4
    if args.child:
        print(json.dumps(child(args)))
        return
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    sizes = ["--hidden", str(args.hidden), "--layers", str(args.layers)]
    sizes += ["--experts", str(args.experts), "--vocab", str(args.vocab)]
    sizes += ["--smoke"] if args.smoke else []
    for i in range(args.iters):
        for variant in VARIANTS if i % 2 == 0 else tuple(reversed(VARIANTS)):
            out = subprocess.run(
                [sys.executable, __file__, "--child", variant, *sizes],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            runs[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
    median = {
        v: {k: statistics.median(r[k] for r in rs) for k in ("seconds", "peak_above_build_mib")}
        for v, rs in runs.items()
    }
    model_mib = runs["forward"][0]["model_mib"]
    peak = {v: m["peak_above_build_mib"] for v, m in median.items()}
    print(
        json.dumps(
            {
                "torch": torch.__version__,
                "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
                "parameters": runs["measure"][0]["parameters"],
                "model_mib": model_mib,
                "batch_logits_mib": runs["measure"][0]["batch_logits_mib"],
                "candidates": runs["measure"][0]["candidates"],
                "iters": args.iters,
                "median": median,
                "measure_over_forward_seconds": median["measure"]["seconds"]
                / median["forward"]["seconds"],
                "extra_peak_over_model": (peak["measure"] - peak["forward"]) / model_mib,
                "extra_peak_over_bf16_forward": (peak["measure"] - peak["forward_bf16"])
                / model_mib,
                "extra_peak_over_bf16_forward_in_batch_logits": (
                    peak["measure"] - peak["forward_bf16"]
                )
                / runs["measure"][0]["batch_logits_mib"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
