"""Step time and collectives per step through accelerate's FSDP2 plugin, side by side in one run.

    python benchmarks/bench_accelerate.py [--nproc 2] [--iters 20] [--hidden 128] [--layers 4]
        [--smoke]

Three copies of one DeepSeek-V3 (transformers, from its config class; its
``_keep_in_fp32_modules_strict`` router gates are what stays in fp32), each prepared by
``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2,
auto_wrap_policy="transformer_based_wrap", ...))``, which makes its own ``fully_shard`` calls
(each decoder layer, the input embedding, ``[norm, lm_head]``, the root):

- ``model_policy``: ``mixed_precision_policy=fsdp_precision.model_policy(model, rules)``: the
  gates gathered in fp32 inside their layers' units;
- ``plain``: accelerate's plain ``MixedPrecisionPolicy(bf16, fp32)``: the gates lose precision;
- ``separate``: the public-API alternative: every gate its own ``param_dtype=None`` unit,
  wrapped before ``prepare`` (accelerate skips modules that are already FSDP units), then the
  plain policy for the rest.

On CPU accelerate would fall back to DDP; ``fsdp_precision.integrations.accelerate_fsdp2_on_cpu``
turns FSDP2 back on (the run fails unless every parameter is a DTensor). Every iteration steps
every variant once, in an order reversed every other iteration; a step's time is its slowest
rank's; ratios are medians over iterations of (variant / plain in the same iteration).
``--smoke``: a tiny model, two iterations, the same code path. Prints JSON on rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import fsdp_precision as fp
from fsdp_precision.integrations import accelerate_fsdp2_on_cpu
from fsdp_precision.testing import CollectiveRecorder, launch, process_group

BF16, FP32 = torch.bfloat16, torch.float32
VARIANTS = ("model_policy", "plain", "separate")
VOCAB = 512


def build(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.hidden // 2, num_hidden_layers=args.layers,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        q_lora_rank=args.hidden // 2, kv_lora_rank=args.hidden // 2, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=128,
    )  # fmt: skip
    return DeepseekV3ForCausalLM(config)


def prepare(
    variant: str, args: argparse.Namespace
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    model = build(args)
    plain = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    if variant == "model_policy":
        policy: MixedPrecisionPolicy = fp.model_policy(
            model, fp.PrecisionRules(param_dtype=BF16, reduce_dtype=FP32)
        )
    else:
        policy = plain
    if variant == "separate":
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                fully_shard(module, mp_policy=MixedPrecisionPolicy(reduce_dtype=FP32))
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, mixed_precision_policy=policy, auto_wrap_policy="transformer_based_wrap"
    )
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", fsdp_plugin=plugin)
    accelerate_fsdp2_on_cpu(accelerator, plugin)
    # FSDP2 in accelerate prepares the model together with its optimizer.
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    plain_params = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain_params:
        raise SystemExit(f"{variant}: accelerate did not shard {plain_params[:3]}: not FSDP2")
    return model, opt


def step_fn(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[[], float]:
    g = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, VOCAB, (4, 32), generator=g)

    def step() -> float:
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - start

    return step


def synced(step: Callable[[], float]) -> float:
    dist.barrier()
    t_max = torch.tensor([step()])
    dist.all_reduce(t_max, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    return float(t_max.item())


def collectives(step: Callable[[], float]) -> dict[str, int]:
    with CollectiveRecorder() as recorder:
        step()
    kinds = [c.kind for c in recorder.calls]
    return {
        "all_gathers": kinds.count("all_gather"),
        "reduce_scatters": kinds.count("reduce_scatter"),
    }


def worker(args: argparse.Namespace) -> dict[str, Any] | None:
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    with process_group(timeout_s=600):
        steps = {v: step_fn(*prepare(v, args)) for v in VARIANTS}
        counts = {v: collectives(steps[v]) for v in VARIANTS}  # also the warm-up step
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for it in range(args.iters):
            for v in VARIANTS if it % 2 == 0 else reversed(VARIANTS):
                times[v].append(synced(steps[v]))
        if counts["model_policy"] != counts["plain"]:
            raise SystemExit(f"model_policy issued other collectives than plain: {counts}")
        ratios = {
            v: statistics.median(t / p for t, p in zip(times[v], times["plain"], strict=True))
            for v in VARIANTS
        }
        return {
            "command": "python " + " ".join(sys.argv),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
            "ranks": world,
            "iters": args.iters,
            "median_step_s": {v: statistics.median(times[v]) for v in VARIANTS},
            "median_paired_ratio_vs_plain": ratios,
            "collectives_per_step": counts,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (CI)")
    args = parser.parse_args()
    if args.smoke:
        args.iters, args.hidden, args.layers = 2, 32, 2
    result = launch(worker, (args,), nproc=args.nproc)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
