"""The trainer-vs-engine per-token logprob mismatch, as RL frameworks measure it, in four setups:
(a) stock vLLM (bf16 router gates), (b) vLLM with the library's plugin (gates kept in fp32), each
against the trainer's own forward; (c) and (d) the same engines against the trainer replaying
the experts each engine routed every token to (``fsdp_precision.replay``).

    python benchmarks/bench_engine_mismatch.py [--seeds 4] [--steps 500] [--prompts 32]
        [--hidden 128] [--layers 2] [--experts 8] [--seq 128] [--cost-pairs 20] [--json PATH]
        [--smoke]

Runs where vLLM is installed (here its CPU build, ``.venv-vllm``; ``.ci/run`` runs ``--smoke``
there). Per seed (the training seed and the held-out prompts' sampling seed): a Qwen3-MoE from
its transformers config (top-2, heads 32 wide, bytes as tokens) trained on the interpreter's help
text (``pydoc_data.topics``, the last 10% held out) with the library's FSDP2 path on one gloo
process (fp32 master weights, bf16 compute, the router gates kept in fp32 by
``Glob("*.mlp.gate.weight")``), AdamW; exported (bulk bf16, gates fp32, the record). The
trainer's own forward gives each held-out token's logprob and, per MoE layer, its top-2 experts.
Then two engines, each in a process of its own (in-process engine,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``enable_return_routed_experts=True``): vLLM with the
plugin on the export (kept) and on a copy with the gates in bf16 and no record (stock: bf16
routers as stock vLLM builds them; the plugin only drives vLLM's own route capture on the CPU
build). Then the trainer again (the trained fp32 weights, reloaded): its live forward (checked
equal to the first) and its forward replaying each engine's routes, with the replayed top-2
checked equal to the engine's on every token and layer; and replay's cost per training step
(forward + backward, paired and interleaved against live routing).

Reported (``engine_mismatch.stats``): mean and max |Δlogprob| of the actual next token, the
k3 mismatch KL (mean of exp(d) - d - 1, d = trainer - engine logprob), mean |Δprob|; per MoE
layer the top-2 agreement with the trainer and the ablation that feeds the engine's own router
inputs (a hook on ``GateLinear``) to the trainer's fp32 router, which splits the end-to-end
disagreement into drift before the router (attention, bf16 kernels) and router precision. Each
with 95% intervals over seeds (t) and over prompts (bootstrap), and the pairs of
``engine_mismatch.stats.PAIRS`` paired.
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
    from engine_mismatch.trainer import held_out_prompts, replay_pass, train_and_export
    from fsdp_precision.testing import launch

    references, replayed, kept, stock, seconds = [], [], [], [], {}
    workdir = Path(tempfile.mkdtemp(prefix="engine-mismatch-"))
    try:
        for seed in seeds:
            export, prompts = str(workdir / f"export{seed}"), str(workdir / f"prompts{seed}.json")
            state = str(workdir / f"state{seed}.pt")
            start = time.perf_counter()
            references.append(launch(train_and_export, (size, seed, export, state), nproc=1))
            Path(prompts).write_text(json.dumps(held_out_prompts(size, seed)))
            middle = time.perf_counter()
            kept.append(run_engine(export, prompts, str(workdir / f"kept{seed}.json"), True))
            stock.append(run_engine(export, prompts, str(workdir / f"stock{seed}.json"), False))
            engines = time.perf_counter()
            routes = {"kept": kept[-1]["routes"], "stock": stock[-1]["routes"]}
            args = (size, seed, state, routes, size.cost_pairs)
            replayed.append(launch(replay_pass, args, nproc=1))
            if replayed[-1]["live"]["logprobs"] != references[-1]["logprobs"]:
                raise RuntimeError(f"seed {seed}: the reloaded trainer's forward differs")
            seconds[seed] = {
                "train": middle - start,
                "engines": engines - middle,
                "replay": time.perf_counter() - engines,
            }
            print(f"seed {seed}: {seconds[seed]}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    variants = {
        "stock": (references, stock),
        "kept": (references, kept),
        "stock_replay": ([r["stock"] for r in replayed], stock),
        "kept_replay": ([r["kept"] for r in replayed], kept),
    }
    return {
        "train": [r["train"] for r in references],
        "seconds": seconds,
        "replay_cost": [r["cost"] for r in replayed],
        "vllm": kept[0]["vllm"],
        "gate_dtypes": {
            "trainer_export": kept[0]["trainer_gate_dtype"],
            "kept": kept[0]["gate_dtype"],
            "stock": stock[0]["gate_dtype"],
        },
        "summary": summarize(variants),
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
    parser.add_argument("--cost-pairs", type=int, default=20, help="replay cost: step pairs")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 1 seed, about a minute")
    args = parser.parse_args()
    if args.smoke:
        args.seeds, args.steps, args.batch, args.prompts, args.seq = 1, 10, 4, 3, 32
        args.hidden, args.layers, args.cost_pairs = 64, 2, 2
    size = Size(
        hidden=args.hidden, layers=args.layers, experts=args.experts, steps=args.steps,
        batch=args.batch, seq=args.seq, prompts=args.prompts, cost_pairs=args.cost_pairs,
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
