"""The trainer-vs-engine per-token logprob mismatch, as RL frameworks measure it: stock vLLM
against vLLM with the library's plugin (router gates kept in fp32), both against the trainer.

    python benchmarks/bench_engine_mismatch.py [--seeds 4] [--steps 500] [--prompts 32]
        [--hidden 128] [--layers 2] [--experts 8] [--seq 128] [--json PATH] [--smoke]

Runs where vLLM is installed (here its CPU build, ``.venv-vllm``; ``.ci/run`` runs ``--smoke``
there). Per seed (the training seed and the held-out prompts' sampling seed): a Qwen3-MoE from
its transformers config (top-2, heads 32 wide, bytes as tokens) trained on the interpreter's help
text (``pydoc_data.topics``, the last 10% held out) with the library's FSDP2 path on one gloo
process (fp32 master weights, bf16 compute, the router gates kept in fp32 by
``Glob("*.mlp.gate.weight")``), AdamW; exported (bulk bf16, gates fp32, the record). The
trainer's own forward gives each held-out token's logprob and, per MoE layer, its top-2 experts.
Then two engines, each in a process of its own (in-process engine,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``): vLLM with the plugin (kept) and stock vLLM
(``VLLM_PLUGINS=lora_filesystem_resolver``: bf16 routers).

Reported (``engine_mismatch.stats``): mean and max |Δlogprob| of the actual next token, the
k3 mismatch KL (mean of exp(d) - d - 1, d = trainer - engine logprob), mean |Δprob|; per MoE
layer the top-2 agreement with the trainer and the ablation that feeds the engine's own router
inputs (a hook on ``GateLinear``) to the trainer's fp32 router, which splits the end-to-end
disagreement into drift before the router (attention, bf16 kernels) and router precision. Each
with 95% intervals over seeds (t) and over prompts (bootstrap), and kept - stock paired.
``--smoke``: tiny sizes, 1 seed (no t interval), the same code path. Prints JSON.
"""

# ci-venv: .venv-vllm

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine_mismatch.trainer import Size


def machine() -> dict[str, Any]:
    """The CPU model (``lscpu``), its core count and the platform."""
    model = platform.processor() or platform.machine()
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
        model = next(line.split(":", 1)[1].strip() for line in lines if "Model name" in line)
    except (OSError, StopIteration):
        pass
    return {"cpu": model, "cores": os.cpu_count(), "platform": platform.platform()}


def run(size: Size, seeds: list[int]) -> dict[str, Any]:
    """Per seed: train and export, then the kept and the stock engine; the summary."""
    from engine_mismatch.engine import run_engine
    from engine_mismatch.stats import summarize
    from engine_mismatch.trainer import held_out_prompts, train_and_export
    from fsdp_precision.testing import launch

    references, kept, stock, seconds = [], [], [], {}
    workdir = Path(tempfile.mkdtemp(prefix="engine-mismatch-"))
    try:
        for seed in seeds:
            export, prompts = str(workdir / f"export{seed}"), str(workdir / f"prompts{seed}.json")
            start = time.perf_counter()
            references.append(launch(train_and_export, (size, seed, export), nproc=1))
            Path(prompts).write_text(json.dumps(held_out_prompts(size, seed)))
            middle = time.perf_counter()
            kept.append(run_engine(export, prompts, str(workdir / f"kept{seed}.json"), True))
            stock.append(run_engine(export, prompts, str(workdir / f"stock{seed}.json"), False))
            seconds[seed] = {"train": middle - start, "engines": time.perf_counter() - middle}
            print(f"seed {seed}: {seconds[seed]}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        "train": [r["train"] for r in references],
        "seconds": seconds,
        "vllm": kept[0]["vllm"],
        "gate_dtypes": {
            "trainer_export": kept[0]["trainer_gate_dtype"],
            "kept": kept[0]["gate_dtype"],
            "stock": stock[0]["gate_dtype"],
        },
        "summary": summarize(references, kept, stock),
    }


def main() -> None:
    """Parses the sizes, runs, prints (and with ``--json`` writes) the result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4, help="training/prompt seeds 0..N-1")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 1 seed, about a minute")
    args = parser.parse_args()
    if args.smoke:
        args.seeds, args.steps, args.batch, args.prompts, args.seq = 1, 10, 4, 3, 32
        args.hidden, args.layers = 64, 2
    size = Size(
        hidden=args.hidden, layers=args.layers, experts=args.experts, steps=args.steps,
        batch=args.batch, seq=args.seq, prompts=args.prompts,
    )  # fmt: skip
    start = time.perf_counter()
    result = run(size, list(range(args.seeds)))
    result = {
        "benchmark": "engine_mismatch",
        "command": " ".join(["python", "benchmarks/bench_engine_mismatch.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": machine(),
        "versions": {"torch": torch.__version__, "vllm": result.pop("vllm")},
        "size": vars(size) | {"seeds": args.seeds, "top_k": 2},
        "wall_seconds": round(time.perf_counter() - start, 1),
        **result,
    }
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
