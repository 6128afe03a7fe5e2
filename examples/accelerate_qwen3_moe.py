"""accelerate's FSDP2 plugin with one ``model_policy``: Qwen3-MoE in bf16, router gates and norms
in fp32, gradients reduced in fp32; saved with accelerate's ``save_state``, resumed with
``load_state`` in a fresh launch, exported with accelerate's API and with the library's.

    torchrun --standalone --nproc_per_node 2 examples/accelerate_qwen3_moe.py --output-dir run

Relaunched with the same ``--output-dir`` (after a preemption, say), it resumes from the newest
checkpoint there and ends bitwise where an uninterrupted run ends.

accelerate makes every ``fully_shard`` call itself (each decoder layer, the embedding, a grouped
``[final norm, lm_head]`` call, the root) with the one policy object; the policy resolves each
call's parameters. The norms return ``weight * x`` and the router calls ``F.linear`` on its
input as it comes: the rules' boundary casts (``boundary="auto"``) cast their inputs to fp32 and
the norms' outputs back to bf16.

Checkpoints, as accelerate's own examples take them (``--checkpointing_steps``): every
``--save-every`` steps ``accelerator.save_state(dir)`` into ``checkpoints/step_<N>``, a directory
named by the step it holds; a relaunch resumes from the newest one with ``load_state`` and skips
the batches already seen with ``skip_first_batches``. Not ``automatic_checkpoint_naming``: it
numbers saves, not steps (``checkpoint_0``, ``checkpoint_1``), and restarts at 0 in a fresh
launch, where the next ``save_state`` raises "Checkpoint directory ... already exists" unless
``project_configuration.iteration`` is set by hand. ``save_state`` writes straight into its
directory (FSDP2's default ``SHARDED_STATE_DICT``: DCP shards in ``pytorch_model_fsdp_0/`` and
``optimizer_0/``, ``random_states_<rank>.pkl``), so a crash mid-save leaves a torn directory: it
is written under a temporary name and renamed once every rank finished, and a resume never sees
a partial one.

Exports, rank 0 writes: ``accelerator.get_state_dict(model)`` + ``save_pretrained`` writes the
fp32 master weights (twice a bf16 checkpoint); ``export_safetensors(model, dir,
dtype=torch.bfloat16)`` writes the bulk in bf16 with the gates and norms it kept in fp32, and
``restore_kept`` puts the trained fp32 gates back after ``from_pretrained(dir,
dtype=torch.bfloat16)`` rounded them (Qwen3-MoE declares no keep for them).

On GPUs drop ``cpu=True`` and ``accelerate_fsdp2_on_cpu`` (on a CPU-only machine accelerate would
fall back to DDP). CI runs this file; ``tests/integrations/test_accelerate.py`` resumes it in a
fresh launch and compares with the uninterrupted run (``--out``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from fsdp_precision import Glob, PrecisionRules, model_policy
from fsdp_precision.checkpoint import check_checkpoint, export_safetensors, restore_kept
from fsdp_precision.integrations import accelerate_fsdp2_on_cpu
from fsdp_precision.testing import GatherProbe

VOCAB = 128
KEPT = ("mlp.gate.weight", "norm.weight")


def dataset(steps: int, world: int) -> list[dict[str, torch.Tensor]]:
    """Token sequences for ``steps`` steps of 2 sequences per rank (the same in every launch)."""
    g = torch.Generator().manual_seed(1)
    return [
        {"input_ids": torch.randint(0, VOCAB, (16,), generator=g)} for _ in range(2 * steps * world)
    ]


def latest(checkpoints: Path) -> tuple[Path | None, int]:
    """The newest complete checkpoint (``step_<N>``; never a ``.tmp`` one) and its step."""
    done = [p for p in checkpoints.glob("step_*") if p.name.removeprefix("step_").isdigit()]
    if not done:
        return None, 0
    newest = max(done, key=lambda p: int(p.name.removeprefix("step_")))
    return newest, int(newest.name.removeprefix("step_"))


def save(accelerator: Accelerator, checkpoints: Path, step: int) -> None:
    """``save_state`` into a temporary directory, renamed once every rank has written."""
    tmp = checkpoints / f".step_{step}.tmp"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)  # what a crash in an earlier save of this step left
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        os.replace(tmp, checkpoints / f"step_{step}")
    accelerator.wait_for_everyone()


def file_dtypes(path: Path) -> dict[str, torch.dtype]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output-dir",
        default="",
        help="checkpoints and exports (default: one per launch, in the temp dir)",
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--out", default="", help="rank 0 writes the final state here (tests)")
    args = parser.parse_args()
    run = os.environ.get("TORCHELASTIC_RUN_ID", "local")  # one per torchrun launch, all ranks
    root = Path(
        args.output_dir or os.path.join(tempfile.gettempdir(), f"accelerate-qwen3-moe-{run}")
    )

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)  # fp32 master weights
    rules = PrecisionRules(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        rules=(Glob("*.mlp.gate.weight"), Glob("*norm.weight")),
    )
    policy = model_policy(model, rules)  # on the model you prepare, before prepare
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, mixed_precision_policy=policy, auto_wrap_policy="transformer_based_wrap"
    )
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", fsdp_plugin=plugin)
    accelerate_fsdp2_on_cpu(accelerator, plugin)  # CPU only
    loader = DataLoader(dataset(args.steps, accelerator.num_processes), batch_size=2)
    model, optimizer, loader = accelerator.prepare(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), loader
    )

    checkpoints = root / "checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)
    resume, start = latest(checkpoints)
    if resume is not None:
        # DCP's default reader unpickles what it reads: check the model's and the optimizer's
        # directories as the library's own loads check theirs, before accelerate reads them.
        check_checkpoint(resume)
        accelerator.load_state(str(resume))  # parameters, optimizer, RNG states
        loader = accelerator.skip_first_batches(loader, start)
        accelerator.print(f"resumed from {resume.name}: step {start}")
    trained = 0
    for step, batch in enumerate(loader, start=start + 1):
        ids = batch["input_ids"]
        with GatherProbe(model) as probe:  # what FSDP gathered each parameter in
            loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        trained += 1
        if step % args.save_every == 0 or step == args.steps:
            save(accelerator, checkpoints, step)
    if trained:
        assert all(isinstance(p, DTensor) for p in model.parameters()), "FSDP2 did not wrap it"
        kept = {n for n in probe.seen if n.endswith(KEPT)}
        assert kept and all(probe.seen[n].dtype == torch.float32 for n in kept)
        assert all(t.dtype == torch.bfloat16 for n, t in probe.seen.items() if n not in kept)
        accelerator.print(
            f"steps {start + 1}-{args.steps}, loss {loss.item():.4f}; {len(kept)} gates and norms "
            f"gathered in fp32, the other {len(probe.seen) - len(kept)} parameters in bf16, "
            "on FSDP2"
        )

    # accelerate's export: the full state dict on rank 0 (fp32 master weights), save_pretrained.
    state = accelerator.get_state_dict(model)  # collective
    optim = get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    accelerate_export = root / "export-accelerate"
    accelerator.unwrap_model(model).save_pretrained(
        accelerate_export, state_dict=state, is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
    )  # fmt: skip
    # The library's: bf16 bulk, the kept gates and norms in fp32, one unit at a time.
    export = root / "export-bf16"
    export_safetensors(model, export, dtype=torch.bfloat16, step=args.steps)  # collective
    if accelerator.is_main_process:
        written = file_dtypes(accelerate_export / "model.safetensors")
        assert set(written.values()) == {torch.float32}, set(written.values())
        ours = file_dtypes(export / "model.safetensors")
        ours_kept = {n for n, d in ours.items() if d == torch.float32}
        assert ours_kept == {n for n in ours if n.endswith(KEPT)}, ours_kept
        reloaded = AutoModelForCausalLM.from_pretrained(export, dtype=torch.bfloat16)
        params = dict(reloaded.named_parameters())
        gates = [n for n in ours_kept if n.endswith("mlp.gate.weight")]
        assert gates and all(params[n].dtype == torch.bfloat16 for n in gates)  # rounded
        restored = restore_kept(reloaded, export)
        assert set(restored) == ours_kept, sorted(set(restored) ^ ours_kept)
        for name in ours_kept:  # the trained fp32 values, bit for bit
            assert params[name].dtype == torch.float32 and torch.equal(params[name], state[name])
        print(
            f"exported: accelerate's save_pretrained {len(written)} tensors in fp32; "
            f"export_safetensors {len(ours) - len(ours_kept)} in bf16, {len(ours_kept)} kept in "
            f"fp32; from_pretrained(bf16) + restore_kept: the {len(gates)} gates and "
            f"{len(ours_kept) - len(gates)} norms equal the trained fp32 values"
        )
        if args.out:
            final = {"start": start, "trained": trained, "params": state, "optim": optim}
            torch.save(final, args.out)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter shutdown: gloo's threads can abort a rank that finished
