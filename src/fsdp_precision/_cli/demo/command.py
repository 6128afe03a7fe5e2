"""``fsdp-precision demo``: a real distributed training job with exact per-parameter precision.

Two phases, each in its own processes (gloo on CPU, NCCL when every rank has a GPU): **train** on
``nproc`` ranks next to a separate-units reference, with a sharded checkpoint halfway, then
**resume** on ``resume_nproc`` ranks. The job itself is the library's
(:mod:`fsdp_precision._cli.demo.job`, typed results); this module parses the options, starts the
processes, and prints the plan, the progress, the per-unit table and the summary.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_precision._base.devices import local_cuda_index, rank_device
from fsdp_precision._base.dist import is_rank0, under_torchrun
from fsdp_precision._base.launch import launch, process_group
from fsdp_precision._cli.demo.job import DemoJob, Training, resume, smallest_block
from fsdp_precision._cli.demo.model import (
    DemoModel,
    demo_model,
    micro_batch,
    micro_batches_per_step,
)
from fsdp_precision._cli.demo.present import processes, progress, say, summary, unit_table
from fsdp_precision._cli.demo.results import (
    ResumeResult,
    TrainResult,
    resume_is_bitwise_expected,
)
from fsdp_precision._cli.options import parse_keep, precision_rules
from fsdp_precision._train.config import DistributedConfig
from fsdp_precision._train.wrap import plan_model_for_training

__all__ = ["DemoOptions", "run"]

_TRAIN, _RESUME = "train.json", "resume.json"


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    """What the demo runs (the command line's options)."""

    nproc: int = 2
    resume_nproc: int | None = None
    steps: int = 8
    model: str = "auto"
    dim: int = 64
    depth: int = 2
    precision: str = "bf16"
    keep: tuple[str, ...] = ()
    output_dir: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        lows = (("nproc", 1), ("steps", 2), ("dim", 8), ("depth", 1), ("seed", 0))
        for name, low in lows:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"--{name} must be an integer >= {low}, got {value!r}")
        if self.resume_nproc is not None and self.resume_nproc < 1:
            raise ValueError(f"--resume-nproc must be an integer >= 1, got {self.resume_nproc}")
        if self.dim % 4:
            raise ValueError(f"--dim must be a multiple of 4 (4 attention heads), got {self.dim}")
        if self.precision not in ("bf16", "fp16"):
            raise ValueError(f"--precision must be bf16 or fp16, got {self.precision!r}")
        for rule in self.keep:
            parse_keep(rule)
        demo_model(self.model, dim=self.dim, depth=self.depth)  # validates --model and --dim

    @property
    def resume_world(self) -> int:
        """Ranks of the resumed run: 1 after a multi-rank run, 2 after a one-rank run."""
        if self.resume_nproc is not None:
            return self.resume_nproc
        return 1 if self.nproc > 1 else 2

    @property
    def checkpoint_step(self) -> int:
        """The step after which the sharded checkpoint is saved (halfway)."""
        return self.steps // 2

    @property
    def bitwise_resume_expected(self) -> bool:
        """Whether the gradient sums of both world sizes are computed in the same order."""
        return resume_is_bitwise_expected(self.nproc, self.resume_world)


# --------------------------------------------------------------------------- launch


def run(opts: DemoOptions) -> int:
    """Run both phases and print the summary; returns the exit code (0: checks passed).

    Under torchrun the training phase runs in the launched ranks and rank 0 then starts the
    resume phase's processes itself."""
    started = time.perf_counter()
    if under_torchrun() and int(os.environ["WORLD_SIZE"]) != opts.nproc:
        opts = replace(opts, nproc=int(os.environ["WORLD_SIZE"]))
    _preflight(opts)
    out = _output_dir(opts) if opts.output_dir is not None else None
    if under_torchrun():
        train = _train_rank(opts, out)
        if not is_rank0():
            return 0
    else:
        out = out or Path(tempfile.mkdtemp(prefix="fsdp-precision-demo-"))
        train = launch(_train_rank, (opts, out), nproc=opts.nproc)
    assert train is not None
    out = Path(train.output_dir)
    try:
        # A torchrun rank has run autograd by now: its children must start fresh (no fork).
        method = "spawn" if under_torchrun() else "auto"
        with _outside_torchrun():
            resume = launch(_resume_rank, (opts, out), nproc=opts.resume_world, start_method=method)
        assert resume is not None
        return summary(opts, train, resume, time.perf_counter() - started)
    finally:
        if opts.output_dir is None:
            shutil.rmtree(out, ignore_errors=True)


def _preflight(opts: DemoOptions) -> None:
    """Compile the plan on the meta device before any process starts, so that rules that match
    nothing or cannot be honoured fail as one clear line (exit 2), not inside the ranks."""
    spec = demo_model(opts.model, dim=opts.dim, depth=opts.depth)
    with torch.device("meta"):
        model = spec.build()
    plan_model_for_training(model, _config(opts, spec, model), world_size=opts.nproc)


def _config(opts: DemoOptions, spec: DemoModel, model: nn.Module) -> DistributedConfig:
    return DistributedConfig(
        fsdp_mixed_precision=precision_rules(opts.precision, opts.keep, spec.rules),
        fsdp_auto_wrap_min_params=smallest_block(model),
    )


def _output_dir(opts: DemoOptions) -> Path:
    out = Path(str(opts.output_dir)).absolute()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output-dir {opts.output_dir!r} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


@contextmanager
def _outside_torchrun() -> Iterator[None]:
    """Hide torchrun's environment while rank 0 starts processes of its own."""
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK"}
    saved = {n: v for n, v in os.environ.items() if n in names or n.startswith("TORCHELASTIC_")}
    for name in saved:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.update(saved)


def demo_uses_cuda(env: Mapping[str, str], cuda: bool, devices: int) -> bool:
    """NCCL on GPUs only where every rank of this node has a GPU of its own (``LOCAL_WORLD_SIZE``,
    else ``WORLD_SIZE``, ranks): the same answer on every rank of the node."""
    local_ranks = int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    return cuda and devices >= local_ranks


@contextmanager
def _rank_group() -> Iterator[None]:
    """This rank's process group: NCCL where every rank of the node has a GPU of its own, else
    gloo on one thread each. One decision for all ranks: deciding per rank (``LOCAL_RANK <
    device_count``) put rank 0 of two on NCCL and rank 1 on gloo on a one-GPU machine, and the
    first collective hung."""
    use_cuda = demo_uses_cuda(os.environ, torch.cuda.is_available(), torch.cuda.device_count())
    if use_cuda:
        # Deterministic kernels (DeepSeek-V3's index_add_, cuBLAS' workspaces), so that the
        # parity with separate units can be bitwise up to 2 ranks; set before CUDA starts.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        local_cuda_index()  # cuda:LOCAL_RANK made current before the group exists
    else:
        torch.set_num_threads(1)
    with process_group("nccl" if use_cuda else "gloo"):
        yield


# --------------------------------------------------------------------------- the ranks


def _job(opts: DemoOptions) -> tuple[DemoModel, DemoJob]:
    started = time.perf_counter()
    spec = demo_model(opts.model, dim=opts.dim, depth=opts.depth)
    device = rank_device()
    torch.manual_seed(opts.seed)
    with torch.device(device):
        model = spec.build()
    return spec, DemoJob(
        name=spec.name,
        model=model,
        config=_config(opts, spec, model),
        loss=spec.loss,
        batch=lambda step, index: micro_batch(
            spec, seed=opts.seed, step=step, index=index, device=device
        ),
        micro=micro_batches_per_step(opts.nproc, opts.resume_world),
        device=device,
        started=started,
    )


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def _train_rank(opts: DemoOptions, out: Path | None) -> TrainResult | None:
    """Phase 1 on this rank; rank 0 returns the results (``out=None``: rank 0 makes a
    temporary directory for everyone, under torchrun)."""
    with _rank_group():
        shared: list[Any] = [out]
        if out is None:
            if dist.get_rank() == 0:
                shared[0] = Path(tempfile.mkdtemp(prefix="fsdp-precision-demo-"))
            dist.broadcast_object_list(shared, src=0)
        return _train(opts, shared[0])


def _train(opts: DemoOptions, out: Path) -> TrainResult | None:
    spec, job = _job(opts)
    world, backend = dist.get_world_size(), dist.get_backend()
    n_params = sum(p.numel() for p in job.model.parameters())
    plan = plan_model_for_training(job.model, job.config)
    say(
        f"fsdp-precision demo: train on {world} processes ({backend}, {job.device.type}), "
        f"torch {torch.__version__}",
        f"model: {job.name}, {n_params:,} parameters, fp32 master weights",
        f"precision: {opts.precision} compute, fp32 reduce; "
        + (f"--keep {' '.join(opts.keep)}; " if opts.keep else "")
        + spec.rules_note,
        "",
        plan.explain(max_params=6),
        "",
    )
    training = Training(job, plan)
    if training.reference_note is not None:
        say(f"reference: {training.reference_note}; only the resume check runs", "")
    result = training.run(
        steps=opts.steps,
        checkpoint_step=opts.checkpoint_step,
        out=out,
        on_step=progress(opts.steps, "train "),
    )
    if result.mismatches:
        print(
            f"rank {dist.get_rank()}: parity FAILED: " + "; ".join(result.mismatches[:8]),
            flush=True,
        )
    if result.parity is not None:
        say("", *unit_table(result.units, result.counts))
    if dist.get_rank() != 0:
        return None
    _write(out / _TRAIN, result.to_dict())
    return result


def _resume_rank(opts: DemoOptions, out: Path) -> ResumeResult | None:
    """Phase 2 on this rank; rank 0 returns the results."""
    with _rank_group():
        _, job = _job(opts)
        k = opts.checkpoint_step
        say(
            "",
            f"resume on {processes(dist.get_world_size())}: load the sharded checkpoint "
            f"of step {k} (saved by {opts.nproc} ranks), train steps {k + 1}..{opts.steps}",
        )
        result = resume(
            job, out, steps=opts.steps, on_step=progress(opts.steps - k, "resume", offset=k)
        )
        if result is not None:
            _write(out / _RESUME, result.to_dict())
        return result
