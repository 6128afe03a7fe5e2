"""``fsdp-precision demo``: a real distributed training job with exact per-parameter precision.

Two phases, each in its own processes (gloo on CPU, NCCL when every rank has a GPU): **train** on
``nproc`` ranks next to a separate-units reference, with a sharded checkpoint halfway, then
**resume** on ``resume_nproc`` ranks. The job itself is the library's
(:mod:`fsdp_precision._demo_job`, typed results); this module parses the options, starts the
processes, and prints the plan, the progress, the per-unit table and the summary.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_precision._config import DistributedConfig
from fsdp_precision._demo_job import DemoJob, Training, resume, smallest_block
from fsdp_precision._demo_results import (
    ResumeResult,
    TrainResult,
    UnitGathers,
    resume_is_bitwise_expected,
)
from fsdp_precision._launch import is_rank0, launch, process_group, under_torchrun
from fsdp_precision._wrap import plan_model_for_training

from ._demo_model import DemoModel, demo_model, micro_batch, micro_batches_per_step
from ._plan_cmd import _parse_rule
from ._progress import Progress

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
            _parse_rule(rule)
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
        train = launch(_train_rank, (opts, out), nproc=opts.nproc, start_method=_start_method())
    assert train is not None
    out = Path(train.output_dir)
    try:
        # A torchrun rank has run autograd by now: its children must start fresh (no fork).
        method = "spawn" if under_torchrun() else _start_method()
        with _outside_torchrun():
            resume = launch(_resume_rank, (opts, out), nproc=opts.resume_world, start_method=method)
        assert resume is not None
        return _summary(opts, train, resume, time.perf_counter() - started)
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
        fsdp_mixed_precision=opts.precision,  # type: ignore[arg-type]
        fsdp_auto_wrap_min_params=smallest_block(model),
        precision_rules=tuple(_parse_rule(r) for r in opts.keep) + spec.rules,
    )


def _output_dir(opts: DemoOptions) -> Path:
    out = Path(str(opts.output_dir)).absolute()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output-dir {opts.output_dir!r} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _start_method() -> str:
    # Forked ranks inherit torch and transformers already imported (seconds each); CUDA cannot
    # be used in a forked child, so with GPUs the ranks start fresh.
    return "fork" if sys.platform == "linux" and not torch.cuda.is_available() else "spawn"


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


@contextmanager
def _rank_group() -> Iterator[None]:
    """This rank's process group: NCCL on its GPU when it has one, else gloo on one thread."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() > local_rank
    if use_cuda:
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(1)
    with process_group("nccl" if use_cuda else "gloo"):
        yield


# --------------------------------------------------------------------------- the ranks


def _job(opts: DemoOptions) -> tuple[DemoModel, DemoJob]:
    started = time.perf_counter()
    spec = demo_model(opts.model, dim=opts.dim, depth=opts.depth)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
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


def _say(*lines: str) -> None:
    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)


def _progress(total: int, label: str, offset: int = 0) -> Callable[[int, float], None] | None:
    """``on_step`` for the job: a progress bar on rank 0, nothing elsewhere."""
    if dist.get_rank() != 0:
        return None
    bar = Progress(total, label=label)

    def on_step(step: int, loss: float) -> None:
        bar.update(step - offset, loss=loss)

    return on_step


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
    _say(
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
        _say(f"reference: {training.reference_note}; only the resume check runs", "")
    result = training.run(
        steps=opts.steps,
        checkpoint_step=opts.checkpoint_step,
        out=out,
        on_step=_progress(opts.steps, "train "),
    )
    if result.mismatches:
        print(
            f"rank {dist.get_rank()}: parity FAILED: " + "; ".join(result.mismatches[:8]),
            flush=True,
        )
    if result.parity is not None:
        _say("", *_unit_table(result.units, result.counts))
    if dist.get_rank() != 0:
        return None
    _write(out / _TRAIN, result.to_dict())
    return result


def _unit_table(units: tuple[UnitGathers, ...], counts: dict[str, tuple[int, int]]) -> list[str]:
    width = max(10, *(len(u.name) for u in units))
    header = (
        f"{'FSDP unit':<{width}} {'all-gathered params by dtype (numel)':<40} "
        f"{'bytes/all-gather':>16}  wire"
    )
    lines = ["observed in the first forward (rank 0):", header, "-" * len(header)]
    for unit in units:
        dtypes = ", ".join(f"{k} {v:,}" for k, v in sorted(unit.gathered.items()))
        lines.append(f"{unit.name:<{width}} {dtypes:<40} {unit.forward_bytes:>16,}  {unit.wire}")
    (ag, rs), (ag_ref, rs_ref) = counts["mapped"], counts["reference"]
    return [
        *lines,
        "",
        f"collectives per forward+backward: {ag} all-gathers, {rs} reduce-scatters "
        "(one all-gather per unit per unshard, one reduce-scatter per unit)",
        f"  separate fp32 child units instead: {ag_ref} all-gathers, {rs_ref} reduce-scatters "
        f"(+{ag_ref - ag} and +{rs_ref - rs})",
        "",
    ]


def _resume_rank(opts: DemoOptions, out: Path) -> ResumeResult | None:
    """Phase 2 on this rank; rank 0 returns the results."""
    with _rank_group():
        _, job = _job(opts)
        k = opts.checkpoint_step
        _say(
            "",
            f"resume on {_processes(dist.get_world_size())}: load the sharded checkpoint "
            f"of step {k} (saved by {opts.nproc} ranks), train steps {k + 1}..{opts.steps}",
        )
        result = resume(
            job, out, steps=opts.steps, on_step=_progress(opts.steps - k, "resume", offset=k)
        )
        if result is not None:
            _write(out / _RESUME, result.to_dict())
        return result


# --------------------------------------------------------------------------- summary


def _processes(n: int) -> str:
    return f"{n} process{'es' if n != 1 else ''}"


def _summary(opts: DemoOptions, train: TrainResult, resume: ResumeResult, wall: float) -> int:
    """Print the summary of both phases; return the exit code."""
    k = opts.checkpoint_step
    if resume.bitwise:
        resume_line = (
            f"bitwise identical to the uninterrupted run (losses of steps {k + 1}..{opts.steps}, "
            f"all {resume.parameters} parameters)"
        )
    else:
        resume_line = (
            f"{len(resume.differ)} of {resume.parameters} parameters differ from the "
            f"uninterrupted run, max |diff| {resume.max_abs_diff:.3g}"
            f", losses within {resume.loss_rel_diff:.1e} (relative)"
        )
        resume_line += (
            " (FAILED: between 1 and 2 ranks the gradient sums are computed in the same order)"
            if resume.bitwise_expected
            else f" (expected: {opts.nproc} and {opts.resume_world} ranks sum gradients in a "
            "different order; bitwise identity holds between 1 and 2 ranks)"
        )
    if train.parity is None:
        parity_line = f"skipped: {train.reference_note}"
    elif train.parity:
        parity_line = (
            f"bitwise identical (losses, {train.gradients} sharded gradients and parameters "
            f"after every step, on {_processes(train.world_size)})"
        )
    else:
        parity_line = "FAILED (see the rank messages above)"
    where = (
        f"kept in {train.output_dir}"
        if opts.output_dir is not None
        else "removed (keep it with --output-dir DIR)"
    )
    lines = [
        "",
        "summary",
        f"  model       {train.model}",
        f"  kept        {len(train.kept)} parameters: {', '.join(train.kept[:4])}"
        + (", ..." if len(train.kept) > 4 else ""),
        f"  trained     {opts.steps} steps on {_processes(train.world_size)} "
        f"({train.backend}, {train.device}), loss {train.losses[0]:.4f} -> {train.losses[-1]:.4f}",
        f"  parity      vs separate fp32 units: {parity_line}",
    ]
    if train.counts:
        (ag, rs), (ag_ref, rs_ref) = train.counts["mapped"], train.counts["reference"]
        lines.append(
            f"  collectives {ag} all-gathers + {rs} reduce-scatters per forward+backward "
            f"(separate fp32 units: {ag_ref} + {rs_ref})"
        )
    lines += [
        f"  checkpoint  sharded, step {k}, {resume.checkpoint_files} files, "
        f"{resume.checkpoint_bytes / 1024:,.0f} KiB, written by "
        f"{_processes(resume.checkpoint_world_size)}; {where}",
        f"  resumed     on {_processes(resume.world_size)}: {resume_line}",
        f"  time        {wall:.1f} s for both phases, process start-up included (in the "
        f"ranks: train {train.seconds:.1f} s, resume {resume.seconds:.1f} s)",
    ]
    print("\n".join(lines), flush=True)
    ok = train.parity is not False and resume.ok
    if not ok:
        print("demo FAILED", file=sys.stderr, flush=True)
    return 0 if ok else 1
