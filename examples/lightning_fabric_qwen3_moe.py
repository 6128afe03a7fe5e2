"""Lightning Fabric's ``ModelParallelStrategy`` with one ``model_policy`` in its ``parallelize_fn``:
Qwen3-MoE in bf16, router gates and norms in fp32, fp32 gradient reduction; saved with Fabric's
own checkpoints, resumed, exported for ``from_pretrained``.

    torchrun --standalone --nproc_per_node 2 examples/lightning_fabric_qwen3_moe.py --dir run
    torchrun --standalone --nproc_per_node 2 examples/lightning_fabric_qwen3_moe.py --dir run \\
        --stop-after 2      # a preemption: the run ends after step 2's checkpoint
    torchrun --standalone --nproc_per_node 2 examples/lightning_fabric_qwen3_moe.py --dir run
                            # resumes after step 2, bitwise as if it had never stopped

Lightning leaves the ``fully_shard`` calls to ``parallelize_fn``; make them on the
``"data_parallel"`` mesh with one policy. Set ``data_parallel_size`` explicitly (its ``"auto"``
is the number of nodes: on one node nothing would be sharded) and keep ``precision`` at its
default ``"32-true"``: the policy sets what is gathered and reduced. On GPUs use
``accelerator="cuda"``. CI runs this file.

Checkpoints: ``fabric.save(path, state)`` writes a directory: the model's and the optimizer's
shards through ``torch.distributed.checkpoint`` (a ``__<rank>_0.distcp`` per rank, DCP's pickled
``.metadata``), every tensor as stored (the fp32 masters), and rank 0's ``meta.pt``
(``torch.save`` of the rest of ``state``: the step, the losses). It writes in place, and
``fabric.load`` takes any directory holding a ``meta.pt``: a save cut off, or one overwriting an
older checkpoint, can be picked. So each step saves under a temporary name, and rank 0 renames
it to ``step-<N>`` once written: every ``step-*`` is complete, and the newest is resumed from.
Keep plain values in ``state`` (``fabric.load`` reads ``meta.pt`` with ``weights_only``).

Export: ``export_safetensors(model.module, dir, dtype=torch.bfloat16)`` (Fabric's wrapper
removed: the model's own class picks the transformers layout) writes the bulk in bf16 and the
kept gates and norms in fp32, one FSDP unit in memory at a time; ``from_pretrained(dir,
dtype=torch.bfloat16)`` rounds what the model does not declare kept, and ``restore_kept``
puts the trained fp32 values back. Without ``--dir`` the run lives in a temporary directory.
``--out`` writes the final parameters, optimizer state and losses (rank 0), which
``tests/integrations/test_lightning.py`` compares bitwise across launches.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from fsdp_precision import Glob, PrecisionRules, full_weights, model_policy
from fsdp_precision.checkpoint import export_safetensors, restore_kept
from fsdp_precision.testing import GatherProbe

VOCAB = 128
RULES = PrecisionRules(
    param_dtype=torch.bfloat16,
    reduce_dtype=torch.float32,
    rules=(Glob("*.mlp.gate.weight"), Glob("*norm.weight")),
)


def parallelize(model: nn.Module, device_mesh: object) -> nn.Module:
    """Fabric's parallelize_fn (the Trainer's configure_model makes the same calls)."""
    policy = model_policy(model, RULES)
    mesh = device_mesh["data_parallel"]  # type: ignore[index]
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def batch(step: int, rank: int) -> torch.Tensor:
    """Step ``step``'s tokens on ``rank``: a resumed run sees what the uninterrupted one saw."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (2, 16), generator=generator)


def latest(checkpoints: Path) -> Path | None:
    """The newest complete checkpoint (temporary names are never complete)."""
    done = sorted(checkpoints.glob("step-*"))
    return done[-1] if done else None


def save(fabric: Fabric, checkpoints: Path, state: dict[str, object], keep: int = 2) -> None:
    """``fabric.save`` under a temporary name, renamed by rank 0 once every rank has written."""
    final = checkpoints / f"step-{state['step']:06d}"
    partial = checkpoints / f".{final.name}.partial"
    if fabric.global_rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a save cut off in an earlier launch
    fabric.barrier()
    fabric.save(partial, state)
    fabric.barrier()  # every rank's shards are written; rank 0 wrote .metadata and meta.pt last
    if fabric.global_rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for old in sorted(checkpoints.glob("step-*"))[:-keep]:
            shutil.rmtree(old)
    fabric.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="", help="the run's directory (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--stop-after", type=int, default=0, help="end after this step's save")
    parser.add_argument("--out", default="", help="rank 0 saves the final state here")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # torchrun's processes; Fabric attaches to them
    world = dist.get_world_size()
    strategy = ModelParallelStrategy(
        parallelize_fn=parallelize, data_parallel_size=world, tensor_parallel_size=1
    )
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    fresh = not args.dir and fabric.global_rank == 0
    run = Path(fabric.broadcast(tempfile.mkdtemp(prefix="fabric-qwen3-") if fresh else args.dir))
    checkpoints = run / "checkpoints"
    if fabric.global_rank == 0:
        checkpoints.mkdir(parents=True, exist_ok=True)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = fabric.setup(AutoModelForCausalLM.from_config(config))  # calls parallelize
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    state: dict[str, object] = {"model": model, "optimizer": optimizer, "step": 0, "losses": []}

    resume = fabric.broadcast(latest(checkpoints))
    if resume is not None:
        fabric.load(resume, state)  # fills the model's and optimizer's shards, step and losses
    start = int(state["step"])  # type: ignore[call-overload]
    losses: list[float] = state["losses"]  # type: ignore[assignment]
    for step in range(start + 1, args.steps + 1):
        ids = batch(step, fabric.global_rank)
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        state["step"] = step
        save(fabric, checkpoints, state)
        if step == args.stop_after:
            fabric.print(f"stopped after step {step}'s checkpoint (a simulated preemption)")
            return
    assert all(isinstance(p, DTensor) for p in model.parameters()), "FSDP2 did not wrap it"
    prompt = batch(0, 0)
    with torch.no_grad(), GatherProbe(model.module) as probe:
        logits = model(input_ids=prompt).logits  # the trained model (collective)
    kept = {n for n in probe.seen if n.endswith(("mlp.gate.weight", "norm.weight"))}
    assert kept and all(probe.seen[n].dtype == torch.float32 for n in kept)
    assert all(t.dtype == torch.bfloat16 for n, t in probe.seen.items() if n not in kept)

    # Export: the bulk in bf16, kept gates and norms in fp32 (collective; rank 0 writes).
    export = run / "export"
    export_safetensors(model.module, export, dtype=torch.bfloat16, step=args.steps)
    trained = full_weights(model.module, dtype="stored", ranks="rank0", device="cpu")
    masters = dict(trained)  # rank 0: the fp32 masters, Hugging Face names; others: {}
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    optim = get_optimizer_state_dict(model.module, optimizer.optimizer, options=full)
    if fabric.global_rank == 0:
        loaded = AutoModelForCausalLM.from_pretrained(export, dtype=torch.bfloat16)
        restored = restore_kept(loaded, export)  # the fp32 gates and norms, bit for bit
        assert sorted(restored) == sorted(kept), (restored, kept)  # and nothing else
        for name in restored:
            tensor = loaded.get_parameter(name)
            assert tensor.dtype == torch.float32 and torch.equal(tensor, masters[name]), name
        assert torch.equal(loaded(input_ids=prompt).logits, logits), "reloaded logits differ"
        if args.out:
            torch.save({"params": masters, "optim": optim, "losses": losses}, args.out)
        print(
            f"step {args.steps}, loss {losses[-1]:.4f} (started after step {start}); {len(kept)} "
            f"gates and norms gathered in fp32, the other {len(probe.seen) - len(kept)} "
            f"parameters in bf16, on FSDP2; exported bf16 with {len(restored)} kept in fp32, "
            "reloaded with the trained logits"
        )
        if not args.dir:
            shutil.rmtree(run)


if __name__ == "__main__":
    main()
    dist.barrier()  # no rank tears its connections down while a peer still uses them
    dist.destroy_process_group()
    # Leave without interpreter shutdown (as examples/elastic_resume.py does): a gloo worker
    # thread can still hold the last collective's work, and releasing it while the interpreter
    # finalises can abort a rank that finished. Everything is written and the group destroyed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
