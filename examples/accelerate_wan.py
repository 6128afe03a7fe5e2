"""A Diffusers Wan transformer trained through accelerate's FSDP2 plugin with one
``model_policy``, checkpointed with ``save_state``, exported to what
``WanTransformer3DModel.from_pretrained`` loads.

    torchrun --standalone --nproc_per_node 2 examples/accelerate_wan.py --output-dir run   # CPU

``WanTransformer3DModel`` declares ``_keep_in_fp32_modules`` (``scale_shift_table``,
``time_embedder``, the ``norm2`` cross-attention norms, ``rope``, ...): ``model_policy`` keeps
them in fp32 inside their units, everything else is gathered in bf16, gradients reduced in fp32.
The timestep projection (``condition_embedder.time_proj``) is kept in fp32 too, and its output
``temb`` reaches every block in fp32 with the rotary tables: ``uncast_inputs`` exempts them from
the block units' input cast, which would round them to bf16 (timestep 998 becomes 1000) though
each block upcasts ``temb`` itself, as the unsharded model computes. A
flow-matching step on random latents: the model predicts the velocity ``noise - latents`` at a
random time. Every ``--save-every`` steps ``accelerator.save_state`` writes
``checkpoints/step_<N>`` (under a temporary name, renamed once every rank has written: accelerate
writes straight into its directory); a relaunch with the same ``--output-dir`` resumes from the
newest one (``examples/accelerate_qwen3_moe.py`` is the same loop, tested for a bitwise resume).

Then ``export_safetensors(model, dir, dtype=torch.bfloat16)``: ``config.json`` and
``diffusion_pytorch_model.safetensors``, the bulk in bf16 and the kept tensors in fp32.
``from_pretrained(dir, torch_dtype=torch.bfloat16)`` keeps Wan's declared modules in fp32 by
itself; ``restore_kept`` puts back what else the plan kept (the timestep projection) and the
boundary casts. The kept tensors reload equal to their trained fp32 values.

On GPUs drop ``cpu=True`` and ``accelerate_fsdp2_on_cpu``. CI runs this file.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from diffusers import WanTransformer3DModel
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from fsdp_precision import Glob, PrecisionRules, model_policy
from fsdp_precision.checkpoint import (
    check_checkpoint,
    export_safetensors,
    read_export_record,
    restore_kept,
)
from fsdp_precision.integrations import accelerate_fsdp2_on_cpu
from fsdp_precision.testing import GatherProbe


def tiny_wan() -> WanTransformer3DModel:
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32,
    )  # fmt: skip


def dataset(size: int) -> list[dict[str, torch.Tensor]]:
    """Latents (channels 4, frames 2, 4x4) and text embeddings, the same in every launch."""
    g = torch.Generator().manual_seed(1)
    return [
        {"latents": torch.randn(4, 2, 4, 4, generator=g), "text": torch.randn(5, 16, generator=g)}
        for _ in range(size)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output-dir",
        default="",
        help="checkpoints and export (default: one per launch, in the temp dir)",
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-every", type=int, default=2)
    args = parser.parse_args()
    run = os.environ.get("TORCHELASTIC_RUN_ID", "local")  # one per torchrun launch, all ranks
    root = Path(args.output_dir or os.path.join(tempfile.gettempdir(), f"accelerate-wan-{run}"))

    torch.manual_seed(0)
    model = tiny_wan()  # fp32 master weights
    rules = PrecisionRules(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        rules=(Glob("condition_embedder.time_proj.*"),),  # temb computed in fp32 ...
        uncast_inputs=("temb", "rotary_emb"),  # ... and kept so into every block
    )
    policy = model_policy(model, rules)  # + Wan's own _keep_in_fp32_modules
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, mixed_precision_policy=policy, auto_wrap_policy="transformer_based_wrap"
    )
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", fsdp_plugin=plugin)
    accelerate_fsdp2_on_cpu(accelerator, plugin)  # CPU only
    loader = DataLoader(dataset(args.steps * accelerator.num_processes), batch_size=1)
    model, optimizer, loader = accelerator.prepare(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), loader
    )
    arrived: set[tuple[str, torch.dtype]] = set()  # what each block unit's forward receives
    for block in model.blocks:
        block.register_forward_pre_hook(
            lambda m, a, k: arrived.update({("temb", a[2].dtype), ("rotary", a[3][0].dtype)}),
            with_kwargs=True,
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
    g = torch.Generator()
    for step, batch in enumerate(loader, start=start + 1):
        g.manual_seed(1000 * step + accelerator.process_index)  # the same after a resume
        latents = batch["latents"]
        noise = torch.randn(latents.shape, generator=g)
        t = torch.rand(latents.shape[0], generator=g)
        noisy = (1 - t).view(-1, 1, 1, 1, 1) * latents + t.view(-1, 1, 1, 1, 1) * noise
        with GatherProbe(model) as probe:  # what FSDP gathered each parameter in
            velocity = model(
                hidden_states=noisy, timestep=(t * 1000).long(),
                encoder_hidden_states=batch["text"], return_dict=False,
            )[0]  # fmt: skip
        loss = F.mse_loss(velocity.float(), noise - latents)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % args.save_every == 0 or step == args.steps:
            save(accelerator, checkpoints, step)
    if start < args.steps:
        assert all(isinstance(p, DTensor) for p in model.parameters()), "FSDP2 did not wrap it"
        kept = {n for n, t in probe.seen.items() if t.dtype == torch.float32}
        assert kept and all(
            t.dtype == torch.bfloat16 for n, t in probe.seen.items() if n not in kept
        )
        assert arrived == {("temb", torch.float32), ("rotary", torch.float32)}, arrived
        accelerator.print(
            f"steps {start + 1}-{args.steps}, loss {loss.item():.4f}; {len(kept)} kept parameters "
            f"(scale_shift_table, time_embedder, time_proj, norm2) gathered in fp32, the other "
            f"{len(probe.seen) - len(kept)} in bf16, on FSDP2; temb and the rotary tables "
            "reach every block in fp32"
        )

    trained = {n: p.detach().full_tensor() for n, p in model.named_parameters()}  # collective
    export = root / "export"
    export_safetensors(model, export, dtype=torch.bfloat16, step=args.steps)  # collective
    if accelerator.is_main_process:
        kept_names = {k.name for k in read_export_record(export).kept}
        reloaded = WanTransformer3DModel.from_pretrained(export, torch_dtype=torch.bfloat16)
        restore_kept(reloaded, export)
        params = dict(reloaded.named_parameters())
        for name in kept_names:  # the trained fp32 values, bit for bit
            assert params[name].dtype == torch.float32 and torch.equal(params[name], trained[name])
        bulk = [n for n in params if n not in kept_names]
        assert all(params[n].dtype == torch.bfloat16 for n in bulk)
        print(
            f"exported {sorted(p.name for p in export.iterdir())}; "
            f"WanTransformer3DModel.from_pretrained(bf16): {len(kept_names)} kept tensors equal "
            f"the trained fp32 values, {len(bulk)} in bf16"
        )
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter shutdown: gloo's threads can abort a rank that finished
