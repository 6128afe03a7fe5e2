"""An RL loop's weight hand-off: generate with an inference copy, score, update the FSDP2 policy,
hand the new weights to the copy unit by unit, generate again.

    torchrun --standalone --nproc_per_node 2 examples/rl_handoff_qwen3_moe.py   # CPU, tiny

The policy is a Qwen3-MoE trained with FSDP2 (fp32 master weights, bf16 compute, the router
gates kept in fp32 by one ``model_policy``). The inference copy lives on rank 0 in bf16, as an
engine's would. After every update ``full_weights`` hands the weights over one unit at a time in
the dtypes training computed them in (bf16 bulk, fp32 gates), never the whole model on one rank,
and ``load_into`` copies them in with the gates allocated fp32 and the gates' input cast to fp32,
so the copy computes exactly what the policy computes: its logits are checked bit for bit after
every hand-off. Sending one dtype instead (``cast_kept=True``: what a stream cast to a "rollout
dtype" does) rounds the trained gates, and the check says so (``--cast-kept``).

With vLLM or SGLang: pass the stream itself (Hugging Face checkpoint names, the default layout)
to the engine's ``load_weights``, and allocate the router in fp32 there (``stream.kept`` names
what to keep). Here the copy is a Hugging Face model, so the stream uses the model's own names
(``layout="plain"``). CI runs this file.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from fsdp_precision import Glob, PrecisionRules, full_weights, model_policy

VOCAB, PROMPT, NEW = 128, 6, 8


def tiny_checkpoint(directory: str) -> str:
    """A randomly initialised tiny Qwen3-MoE saved in bf16 as a real checkpoint (no download)."""
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(directory)
    return directory


def reward(completions: torch.Tensor) -> torch.Tensor:
    """A toy task: the share of even tokens in each completion."""
    return (completions % 2 == 0).float().mean(dim=1)


def hand_off(policy: torch.nn.Module, engine: torch.nn.Module | None, cast_kept: bool) -> str:
    """The new weights into the inference copy (collective: every rank calls it)."""
    stream = full_weights(
        policy, dtype=torch.bfloat16, cast_kept=cast_kept, ranks="rank0", layout="plain"
    )
    if engine is None:
        stream.drain()  # rank 0 receives; the others take part in each unit's gather
        return ""
    loaded = stream.load_into(engine, casts=not cast_kept)
    kept = {m.dtype for m in stream.kept.values()}
    return f"{len(loaded)} tensors, {stream.nbytes / 1e6:.2f} MB, {len(stream.kept)} kept in {kept}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--cast-kept", action="store_true", help="hand off one dtype (rounds)")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_checkpoint(os.path.join(tmp, f"qwen3-moe-{rank}"))  # before the group exists
        dist.init_process_group("gloo")
        policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # fp32 masters
        rules = PrecisionRules(
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
            rules=(Glob("*.mlp.gate.weight"),),
        )
        mp_policy = model_policy(policy, rules)
        for layer in policy.model.layers:
            fully_shard(layer, mp_policy=mp_policy)
        fully_shard(policy, mp_policy=mp_policy)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        engine = (
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16) if rank == 0 else None
        )

    hand_off(policy, engine, args.cast_kept)  # the engine starts from the policy's weights
    torch.manual_seed(1234)  # sampling: the same prompts and draws on every rank
    probe = torch.randint(0, VOCAB, (2, PROMPT + NEW))
    for iteration in range(args.iterations):
        # Generate (rank 0's engine) and share the rollouts.
        prompts = torch.randint(0, VOCAB, (4, PROMPT))
        rollouts = torch.zeros(4, PROMPT + NEW, dtype=torch.long)
        if engine is not None:
            with torch.no_grad():
                rollouts = engine.generate(
                    prompts, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=True, top_k=0,
                    pad_token_id=0,
                )  # fmt: skip
        dist.broadcast(rollouts, src=0)
        # Score, then a policy-gradient update on this rank's half of the rollouts.
        scores = reward(rollouts[:, PROMPT:])
        advantage = scores - scores.mean()
        mine = slice(rank * 2, rank * 2 + 2)
        logits = policy(input_ids=rollouts[mine]).logits[:, PROMPT - 1 : -1].float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, rollouts[mine, PROMPT:, None])
        loss = -(advantage[mine, None] * logprobs.squeeze(-1)).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        # Hand the updated weights to the engine, then check it computes as the policy does.
        handed = hand_off(policy, engine, args.cast_kept)
        with torch.no_grad():
            trained = policy(input_ids=probe).logits
        if engine is not None:
            with torch.no_grad():
                served = engine(input_ids=probe).logits
            same = torch.equal(served, trained)
            verdict = "bitwise the policy's" if same else "DIFFER from the policy's"
            print(f"iteration {iteration}: reward {scores.mean():.3f}; hand-off {handed}; "
                  f"engine logits {verdict}")  # fmt: skip
            if not same and not args.cast_kept:
                raise SystemExit("the engine does not compute what the policy computes")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter shutdown: gloo's threads can abort a rank that finished
