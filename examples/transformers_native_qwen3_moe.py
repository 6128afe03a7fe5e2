"""transformers' own FSDP2 (``from_pretrained(..., distributed_config=...)``) with the opt-in:
Qwen3-MoE loaded in bf16, its router gates kept in fp32, gradients reduced in fp32; checkpoints
every 2 steps, a resume in a fresh launch, and an export.

    torchrun --standalone --nproc_per_node 2 examples/transformers_native_qwen3_moe.py  # CPU
    # preempted after step 3 (step 2 saved), then a fresh launch resumes and ends at step 4:
    torchrun --standalone --nproc_per_node 2 examples/transformers_native_qwen3_moe.py \
        --output-dir run --stop-after 3
    torchrun --standalone --nproc_per_node 2 examples/transformers_native_qwen3_moe.py \
        --output-dir run

transformers wraps the model itself while loading it and hands every ``fully_shard`` call one
hard-coded ``MixedPrecisionPolicy(bf16, fp32)``; inside ``transformers_native_fsdp(rules)`` every
call gets ``model_policy(model, rules)`` instead. The checkpoint's gates are bf16: the rule keeps
them in fp32 by upcasting them exactly, and its boundary cast casts the router's input. A tiny
checkpoint is written first (no download); use your own path.

transformers' native path has no training loop, so no checkpoint API of its own: the loop saves
with the library's ``save_step`` (DCP, sharded, atomic, the last two kept) and a launch resumes
with ``resume_from_latest``; the resumed run prints the same parameter digest as an
uninterrupted one. At the end ``export_safetensors(model, dir, dtype=torch.bfloat16)`` writes the
transformers layout with the gates in fp32 and a record of them; rank 0 reloads it with
``from_pretrained`` (which rounds the gates) and ``restore_kept`` (which puts them back).
``model.save_pretrained(dir)`` works on the sharded model too (collective; every tensor as
stored: the bulk bf16, the gates fp32, and no record, so ``from_pretrained(dtype=bf16)`` rounds
the gates for good). CI runs this file.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from fsdp_precision import Glob, PrecisionRules
from fsdp_precision.checkpoint import (
    export_safetensors,
    restore_kept,
    resume_from_latest,
    save_step,
)
from fsdp_precision.integrations import transformers_native_fsdp
from fsdp_precision.testing import GatherProbe

VOCAB = 128
STEPS, SAVE_EVERY = 4, 2


def shared_dir(path: str | None) -> str:
    """``path``, or a new temporary directory rank 0 made; the same string on every rank."""
    where = [path or (tempfile.mkdtemp(prefix="native-fsdp-") if dist.get_rank() == 0 else "")]
    dist.broadcast_object_list(where, src=0)
    return where[0]


def tiny_checkpoint(path: str) -> str:
    """Rank 0 saves a randomly initialised tiny Qwen3-MoE; every rank returns when it is written."""
    if dist.get_rank() == 0:
        config = transformers.Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        )  # fmt: skip
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    dist.barrier()
    return path


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole (collective)."""
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def digest(params: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every parameter's name, dtype and bytes."""
    h = hashlib.sha256()
    for name, t in params.items():
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def dtypes_of(directory: Path) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is no mapping
                counts[str(f.get_slice(name).get_dtype())] += 1
    return dict(counts)


def check_export(export: Path, trained: dict[str, torch.Tensor], gates: list[str]) -> str:
    """Rank 0: the export reloads; ``restore_kept`` brings the trained fp32 gates back exactly."""
    loaded = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.bfloat16)
    rounded = {n: p for n, p in loaded.named_parameters() if n in gates}
    assert all(p.dtype == torch.bfloat16 for p in rounded.values())  # Qwen3-MoE keeps none
    assert not all(torch.equal(p.float(), trained[n]) for n, p in rounded.items())
    assert sorted(restore_kept(loaded, export)) == sorted(gates)
    for name, param in loaded.named_parameters():
        assert param.dtype == trained[name].dtype and torch.equal(param, trained[name]), name
    shards = len(list(export.glob("*.safetensors")))
    return (
        f"export: {shards} shards, {dtypes_of(export)}; from_pretrained(dtype=bf16) rounded the "
        f"{len(gates)} gates, restore_kept put back their trained fp32 values (bitwise)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", help="checkpoints and exports (default: a temp dir)")
    parser.add_argument("--stop-after", type=int, help="stop after this step (a preemption)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    output_dir = shared_dir(args.output_dir)
    tmp = shared_dir(None)
    try:
        train(args, Path(output_dir), tiny_checkpoint(os.path.join(tmp, "qwen3-moe")))
        dist.barrier()  # no rank tears its connections down while a peer uses them
    finally:  # no barrier on an error: a peer may be inside a collective
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            if args.output_dir is None:
                shutil.rmtree(output_dir, ignore_errors=True)
    dist.destroy_process_group()


def train(args: argparse.Namespace, output_dir: Path, path: str) -> None:
    rank = dist.get_rank()
    rules = PrecisionRules(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, rules=(Glob("*.mlp.gate.weight"),)
    )
    with transformers_native_fsdp(rules):  # every fully_shard call gets model_policy
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path,
            dtype=torch.bfloat16,
            distributed_config=transformers.DistributedConfig(
                fsdp_size=dist.get_world_size(), fsdp_mixed_precision=True
            ),
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    checkpoints = output_dir / "checkpoints"
    meta = resume_from_latest(checkpoints, model, optimizer)  # collective; None: a first start
    start = meta["step"] + 1 if meta else 1
    losses: list[float] = list(meta["extra"]["losses"]) if meta else []
    last = STEPS if args.stop_after is None else min(STEPS, args.stop_after)
    for step in range(start, last + 1):
        ids = torch.randint(
            0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1000 * step + rank)
        )
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step % SAVE_EVERY == 0:
            save_step(
                checkpoints, model, optimizer, step=step, keep_last=2, extra={"losses": losses}
            )
    started = f"resumed from step {meta['step']}" if meta else "started fresh"
    started += f", trained steps {start}-{last}"
    trained = gathered(model)  # collective
    if last < STEPS:
        if rank == 0:
            print(f"{started}; preempted (parameters sha256 {digest(trained)})")
        return

    gates = [n for n in trained if n.endswith("mlp.gate.weight")]
    if rank == 0:
        print(
            f"{started} (rank 0 loss per step: {', '.join(f'{x:.4f}' for x in losses)}); "
            f"parameters sha256 {digest(trained)}"
        )
    assert all(isinstance(p, DTensor) for p in model.parameters()), "FSDP2 did not wrap it"
    with torch.no_grad(), GatherProbe(model) as probe:
        model(
            input_ids=torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
        )
    assert gates and all(probe.seen[n].dtype == torch.float32 for n in gates)
    assert all(t.dtype == torch.bfloat16 for n, t in probe.seen.items() if n not in gates)
    if rank == 0:
        print(
            f"{len(gates)} router gates gathered in fp32, the other "
            f"{len(probe.seen) - len(gates)} parameters in bf16, on transformers' FSDP2"
        )

    # The exports: the library's and transformers' own (both collective; rank 0 writes).
    export = output_dir / "export"
    export_safetensors(model, export, dtype=torch.bfloat16, max_shard_size="64KB", step=STEPS)
    model.save_pretrained(output_dir / "save_pretrained")
    if rank == 0:
        print(check_export(export, trained, gates))
        print(f"model.save_pretrained: {dtypes_of(output_dir / 'save_pretrained')}, no record")


if __name__ == "__main__":
    main()
    # Leave without interpreter shutdown: a gloo worker thread can still hold the last
    # collective's work, and freeing its tensors once the interpreter finalises aborts a rank
    # that finished ("terminate called without an active exception"); destroy_process_group
    # does not wait for it while the model's device mesh still holds the group.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
